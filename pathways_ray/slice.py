"""One reserved TPU slice with a chip worker on every chip.

Reservation goes through Ray's ``SlicePlacementGroup`` with one bundle per chip
(``{"TPU": 1}``). Around it we work around what it gets wrong (see DESIGN.md):

- a single-host slice gets no slice-name constraint from Ray, and its default
  ``SPREAD`` strategy would scatter 1-chip bundles over several hosts, so we
  pack them onto one host of the right pod type;
- worker 0's ``TPU-<pod>-head`` resource is held for as long as we hold the
  slice, so another reservation cannot pick our busy slice's head and then
  wait forever for chips that will never free;
- bundle 0 is not always TPU worker 0, so ranks come from what each worker
  reports (``TPU_WORKER_ID``, chip index), never from bundle order;
- every wait has a deadline, and a reservation that cannot fit fails with the
  shape asked for, what the cluster has free, and the timeout setting.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pathways_ray.chip_worker import ChipWorker
from pathways_ray.cluster import describe_capacity, slices_from_nodes
from pathways_ray.errors import ReservationTimeout, WorkerDied
from pathways_ray.fleet import NAMESPACE
from pathways_ray.topology import Topology
from pathways_ray.worker_env import ChipInfo, rank_order

__all__ = ["Slice", "SliceWorker", "list_registered_slices"]

logger = logging.getLogger(__name__)

RESERVE_TIMEOUT_ENV = "PATHWAYS_RAY_RESERVE_TIMEOUT_S"
_KV_PREFIX = "pathways-ray/slice/"


def _default_reserve_timeout() -> float:
    raw = os.environ.get(RESERVE_TIMEOUT_ENV, "60")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{RESERVE_TIMEOUT_ENV}={raw!r} must be a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{RESERVE_TIMEOUT_ENV}={raw!r} must be positive")
    return value


@dataclass(frozen=True)
class SliceWorker:
    """A chip worker and where it runs, in rank order."""

    rank: int
    info: ChipInfo
    actor_name: str
    handle: object  # ray.actor.ActorHandle


def _capacity() -> str:
    import ray
    from ray._private.state import available_resources_per_node

    return describe_capacity(slices_from_nodes(ray.nodes(), available_resources_per_node()))


class Slice:
    """A reserved slice: its placement group, its chip workers, one JAX world.

    Use ``Slice.reserve(...)``; release it with ``shutdown()`` or a ``with`` block.
    """

    def __init__(self, topology: Topology, spg, workers: list[SliceWorker], world: list[dict]):
        self.topology = topology
        self._spg = spg
        self.workers = workers
        self.world = world
        self.world_offset = 0  # this slice's first device in its JAX world
        self.name = workers[0].info.slice_name
        self._closed = False

    # ---- reservation -----------------------------------------------------------
    @classmethod
    def reserve(
        cls,
        topology: Topology | str,
        *,
        chips_per_host: int | None = None,
        timeout_s: float | None = None,
        worker_timeout_s: float = 180.0,
        compilation_cache_dir: str | None = None,
        join_world: bool = True,
    ) -> Slice:
        """Reserve one whole slice of ``topology`` and start a worker on every chip.

        ``timeout_s`` bounds the reservation (default ``$PATHWAYS_RAY_RESERVE_TIMEOUT_S``
        or 60 s); ``worker_timeout_s`` bounds starting the workers and their JAX world.
        ``compilation_cache_dir`` (a path every host sees) turns on JAX's persistent
        compilation cache on every chip. ``join_world=False`` starts the workers
        without a JAX world (``reserve_joint`` then joins several slices in one).
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from ray.util.tpu import SlicePlacementGroup

        topo = Topology.of(topology, chips_per_host=chips_per_host)
        if timeout_s is None:
            timeout_s = _default_reserve_timeout()
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be positive")
        if not ray.is_initialized():
            raise RuntimeError(
                "not connected to a Ray cluster; start a pathways_ray.LocalFleet or call "
                "pathways_ray.Fleet.attach(address) first"
            )
        t0 = time.monotonic()
        handle_id = uuid.uuid4().hex[:8]
        single = topo.is_single_host
        selectors = [{"ray.io/tpu-pod-type": topo.pod_type}] * topo.chips
        try:
            spg = SlicePlacementGroup(
                topology=topo.name,
                accelerator_version=topo.generation.ray_version,
                resources_per_bundle={"TPU": 1, "CPU": 1},
                chips_per_vm=topo.chips_per_host,
                strategy="STRICT_PACK" if single else "SPREAD",
                name=f"pathways-ray-{handle_id}",
                head_reservation_timeout_s=timeout_s,
                bundle_label_selector=selectors,
            )
        except TimeoutError as e:
            raise cls._timeout(topo, timeout_s, t0) from e
        except RuntimeError as e:
            raise ReservationTimeout(f"{e}\nThe cluster has:\n{_capacity()}") from e
        pg = spg.slice_placement_group
        remaining = max(0.1, timeout_s - (time.monotonic() - t0))
        ready, _ = ray.wait([pg.ready()], timeout=remaining)
        if not ready:
            spg.shutdown()
            raise cls._timeout(topo, timeout_s, t0)
        logger.info("reserved %s in %.1fs", topo.describe(), time.monotonic() - t0)

        actor_cls = ray.remote(concurrency_groups={"control": 2})(ChipWorker)
        handles, names = [], []
        try:
            for bundle in range(spg.num_bundles):
                name = f"chip-{handle_id}-{bundle}"
                handles.append(
                    actor_cls.options(
                        name=name,
                        namespace=NAMESPACE,
                        num_cpus=1,
                        resources={"TPU": 1},
                        max_restarts=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=bundle
                        ),
                    ).remote()
                )
                names.append(name)
            infos = _get([h.get_info.remote() for h in handles], worker_timeout_s,
                         "starting chip workers", "worker_timeout_s")
            order = rank_order(infos)
            slice_names = {i.slice_name for i in infos}
            if len(slice_names) != 1:
                raise RuntimeError(
                    f"chip workers of one reservation landed on several slices {slice_names}; "
                    f"this is a placement bug, please report it"
                )
            workers = [SliceWorker(r, infos[i], names[i], handles[i]) for r, i in enumerate(order)]
            sl = cls(topo, spg, workers, [])
            if join_world:
                cls._init_world([sl], worker_timeout_s, compilation_cache_dir)
        except BaseException:
            for h in handles:
                ray.kill(h)
            spg.shutdown()
            raise
        if join_world:
            sl._register()
            logger.info("slice %s ready: %d chip workers in %.1fs", sl.name, len(workers),
                        time.monotonic() - t0)
        return sl

    @classmethod
    def reserve_joint(cls, topologies: Sequence[Topology | str], *,
                      timeout_s: float | None = None, worker_timeout_s: float = 180.0,
                      compilation_cache_dir: str | None = None) -> list[Slice]:
        """Reserve several slices whose chips form one JAX world (multislice).

        Each slice still runs its own programs on its own devices; a program
        over a mesh spanning them runs on all, with collectives between slices
        (DCN on TPU, gloo here). The world lives and dies as one: losing any
        slice loses it, as with any multislice job.
        """
        slices: list[Slice] = []
        try:
            for spec in topologies:
                slices.append(cls.reserve(spec, timeout_s=timeout_s,
                                          worker_timeout_s=worker_timeout_s, join_world=False))
            cls._init_world(slices, worker_timeout_s, compilation_cache_dir)
        except BaseException:
            for sl in slices:
                sl.shutdown()
            raise
        for sl in slices:
            sl._register()
        return slices

    @staticmethod
    def _timeout(topo: Topology, timeout_s: float, t0: float) -> ReservationTimeout:
        return ReservationTimeout(
            f"could not reserve a {topo.describe()} slice within timeout_s={timeout_s:g} "
            f"(waited {time.monotonic() - t0:.1f}s). The cluster has:\n{_capacity()}\n"
            f"Release a slice, add hosts of pod type {topo.pod_type}, or wait longer with "
            f"timeout_s= (or ${RESERVE_TIMEOUT_ENV})."
        )

    @staticmethod
    def _init_world(slices: list[Slice], timeout_s: float,
                    compilation_cache_dir: str | None) -> None:
        """One JAX world over the chips of ``slices``, slice after slice in rank order."""
        workers = [w for sl in slices for w in sl.workers]
        ports = _get([w.handle.reserve_port.remote() for w in workers], timeout_s,
                     "reserving ports", "worker_timeout_s")
        addresses = [f"{w.info.ip}:{p}" for w, p in zip(workers, ports, strict=True)]
        coordinator = addresses[0]
        refs, offset = [], 0
        for sid, sl in enumerate(slices):
            n = sl.num_chips
            multislice = ((sid, len(slices), workers[0].info.ip) if len(slices) > 1 else None)
            for w in sl.workers:
                refs.append(w.handle.init_world.remote(
                    coordinator=coordinator,
                    num_processes=len(workers),
                    rank=offset + w.rank,
                    timeout_s=timeout_s,
                    process_addresses=addresses[offset:offset + n],
                    slice_shape=sl.topology.shape,
                    compilation_cache_dir=compilation_cache_dir,
                    slice_devices=(offset, n),
                    multislice=multislice,
                ))
            sl.world_offset = offset
            offset += n
        world = _get(refs, timeout_s + 30, "initializing the JAX world", "worker_timeout_s")
        for info in world:
            if info["device_count"] != len(workers):
                raise RuntimeError(
                    f"rank {info['rank']} sees {info['device_count']} devices, the world has "
                    f"{len(workers)} chips"
                )
        for sl in slices:
            sl.world = world[sl.world_offset:sl.world_offset + sl.num_chips]

    # ---- running ---------------------------------------------------------------------
    @property
    def num_chips(self) -> int:
        return len(self.workers)

    def all_reduce(self, values: Sequence, timeout_s: float = 120.0) -> list:
        """Rank ``r`` contributes ``values[r]``; returns what every rank got back."""
        if len(values) != self.num_chips:
            raise ValueError(
                f"values has {len(values)} entries; the slice has {self.num_chips} chips"
            )
        return self._call_all("all_reduce", [(v,) for v in values], timeout_s)

    def health(self, timeout_s: float = 5.0) -> list[tuple[SliceWorker, str]]:
        """Each worker with ``"ok"``, ``"dead"`` or ``"unresponsive"``."""
        return _ping_all([(w, w.handle) for w in self.workers], timeout_s)

    def _call_all(self, method: str, args: list[tuple], timeout_s: float) -> list:
        refs = [getattr(w.handle, method).remote(*a) for w, a in zip(self.workers, args,
                                                                      strict=True)]
        return _get(refs, timeout_s, f"{method} on slice {self.name}", "timeout_s",
                    workers=self.workers)

    # ---- registry (for `pathways-ray status` in other processes) ------------------
    def _register(self) -> None:
        from ray.experimental import internal_kv

        record = {
            "name": self.name,
            "topology": str(self.topology),
            "chips_per_host": self.topology.chips_per_host,
            "owner_pid": os.getpid(),
            "created": time.time(),
            "workers": [
                {"rank": w.rank, "worker_id": w.info.worker_id, "chip": w.info.chip,
                 "node_id": w.info.node_id, "actor": w.actor_name}
                for w in self.workers
            ],
        }
        internal_kv._internal_kv_put(_KV_PREFIX + self.name, json.dumps(record),
                                     overwrite=True, namespace=NAMESPACE)

    def shutdown(self) -> None:
        """Stop the workers and release the slice."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.experimental import internal_kv

        if not ray.is_initialized():
            return
        # Leave the JAX world together first: killing the coordinator's rank while the
        # others still poll it makes them abort with fatal-error logs.
        refs = [w.handle.shutdown_world.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
        if len(ready) < len(refs):
            logger.info("slice %s: %d chip workers did not leave the JAX world in 10 s",
                        self.name, len(refs) - len(ready))
        for w in self.workers:
            try:
                ray.kill(w.handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._spg.shutdown()
        try:
            internal_kv._internal_kv_del(_KV_PREFIX + self.name, namespace=NAMESPACE)
        except Exception:  # noqa: BLE001
            logger.debug("could not remove registry entry of %s", self.name, exc_info=True)

    def __enter__(self) -> Slice:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Slice({self.name!r}, {self.topology.describe()})"


def _get(refs, timeout_s: float, what: str, setting: str, workers=None):
    """``ray.get`` with a deadline; dead actors become ``WorkerDied``."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"{what} did not finish within {setting}={timeout_s:g}s") from e
    except ray.exceptions.RayActorError as e:
        where = ""
        if workers:
            dead = [w for w, s in _ping_all([(w, w.handle) for w in workers], 2.0) if s != "ok"]
            where = " (" + ", ".join(
                f"rank {w.rank} on TPU worker {w.info.worker_id} chip {w.info.chip}" for w in dead
            ) + ")"
        raise WorkerDied(f"a chip worker died while {what}{where}: {e}") from e


def _ping_all(pairs, timeout_s: float) -> list[tuple[object, str]]:
    import ray

    refs = [h.ping.remote() for _, h in pairs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ready_set = set(ready)
    out = []
    for (item, _), ref in zip(pairs, refs, strict=True):
        if ref not in ready_set:
            out.append((item, "unresponsive"))
            continue
        try:
            ray.get(ref, timeout=0)
            out.append((item, "ok"))
        except ray.exceptions.RayError:
            out.append((item, "dead"))
    return out


def list_registered_slices() -> list[dict]:
    """Slices reserved by any process of this cluster, with their workers' health."""
    import ray
    from ray.experimental import internal_kv

    records = []
    for key in internal_kv._internal_kv_list(_KV_PREFIX, namespace=NAMESPACE):
        raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw:
            records.append(json.loads(raw))
    pairs = []
    for rec in records:
        for w in rec["workers"]:
            try:
                handle = ray.get_actor(w["actor"], namespace=NAMESPACE)
            except ValueError:
                w["health"] = "gone"
                continue
            pairs.append((w, handle))
    for w, state in _ping_all(pairs, 3.0):
        w["health"] = state
    live = []
    for rec in records:
        if all(w["health"] in ("gone", "dead") for w in rec["workers"]):
            # Its owner exited without shutdown() (killed): the actors died with it.
            internal_kv._internal_kv_del(_KV_PREFIX + rec["name"], namespace=NAMESPACE)
        else:
            live.append(rec)
    return sorted(live, key=lambda r: r["name"])
