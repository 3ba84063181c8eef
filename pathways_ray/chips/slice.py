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

import logging
import threading
import time
import uuid
from collections.abc import Sequence

from pathways_ray import boundary
from pathways_ray.chips.chip_worker import ChipWorker
from pathways_ray.chips.handles import SidecarInfo, SliceWorker, _get, ping_all
from pathways_ray.chips.worker_env import rank_order
from pathways_ray.chips.world import form_world
from pathways_ray.clusters import registry
from pathways_ray.clusters.cluster import cluster_slices, describe_capacity
from pathways_ray.clusters.topology import Topology
from pathways_ray.config import NAMESPACE, TIMEOUTS, settings_env
from pathways_ray.errors import ReservationTimeout, WaitTimeout, WorkerDied
from pathways_ray.transport.channel import listening

__all__ = ["Slice"]

logger = logging.getLogger(__name__)

LISTEN_S = 0.5  # a live host completes a TCP handshake within this (Slice.health)


def _capacity() -> str:
    return describe_capacity(cluster_slices())


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
        self._sidecars: list[SidecarInfo] | None = None
        self._sidecar_lock = threading.Lock()
        self._pg = spg.slice_placement_group if spg is not None else None
        self.borrowed = False  # lent by a shared service, which keeps the reservation
        self.listeners: list[tuple[str, int]] = []  # each rank's command server (health)
        # A world of several slices whose coordination service is off the chips (see
        # controller/worlds.py): it outlives any one of them. None: the slice's own world.
        self.world_service = None

    # ---- lending (a shared service's pool, service.py) --------------------------------
    def lend(self) -> dict:
        """What a lease's controller needs to run this slice (``Slice.borrowed``); the
        lender keeps the reservation and its workers' ownership."""
        return {"topology": self.topology, "workers": self.workers, "world": self.world,
                "world_offset": self.world_offset, "pg": self._pg}

    @classmethod
    def borrowed(cls, lent: dict) -> Slice:
        """A slice lent by a service: ``shutdown()`` stops only what the borrower started
        (sidecars), and the workers too if the slice was lost, never the reservation."""
        sl = cls(lent["topology"], None, lent["workers"], lent["world"])
        sl.world_offset = lent["world_offset"]
        sl._pg = lent["pg"]
        sl.borrowed = True
        return sl

    # ---- reservation -----------------------------------------------------------
    @classmethod
    def reserve(
        cls,
        topology: Topology | str,
        *,
        chips_per_host: int | None = None,
        timeout_s: float | None = None,
        worker_timeout_s: float | None = None,
        compilation_cache_dir: str | None = None,
        join_world: bool = True,
        worker_cls: type | None = None,
        track: list | None = None,
    ) -> Slice:
        """Reserve one whole slice of ``topology`` and start a worker on every chip.

        ``timeout_s`` bounds the reservation (default ``$PATHWAYS_RAY_RESERVE_TIMEOUT_S``
        or 120 s); ``worker_timeout_s`` bounds starting the workers and their JAX world
        (default ``$PATHWAYS_RAY_WORKER_START_TIMEOUT_S`` or 180 s).
        ``compilation_cache_dir`` (a path every host sees) turns on JAX's persistent
        compilation cache on every chip. ``join_world=False`` starts the workers
        without a JAX world (``worlds.reserve_joint`` then joins several slices in one).
        ``worker_cls`` replaces ``ChipWorker`` (a subclass, e.g. ``testing.DebugChipWorker``).
        """
        import ray
        from ray.util.tpu import SlicePlacementGroup

        topo = Topology.of(topology, chips_per_host=chips_per_host)
        worker_timeout_s = worker_timeout_s or TIMEOUTS["worker_start"].seconds()
        if timeout_s is None:
            timeout_s = TIMEOUTS["reserve"].seconds()
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
                # A CPU for the chip worker, and one for host-side Python: the host's
                # sidecar (data loading, checkpoint writing) takes one of them.
                resources_per_bundle={"TPU": 1, "CPU": 2},
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
        if track is not None:  # the caller may have to release it before we return
            track.append(spg)
        pg = spg.slice_placement_group
        remaining = max(0.1, timeout_s - (time.monotonic() - t0))
        try:
            boundary.wait([pg.ready()], timeout=remaining, what=f"reserving {topo.describe()}")
        except WaitTimeout:
            spg.shutdown()
            raise cls._timeout(topo, timeout_s, t0) from None
        logger.info("reserved %s in %.1fs", topo.describe(), time.monotonic() - t0)

        handles: list = []
        try:
            workers = cls._start_workers(pg, spg.num_bundles, handle_id, worker_cls,
                                         worker_timeout_s, handles)
            sl = cls(topo, spg, workers, [])
            if join_world:
                form_world([sl], worker_timeout_s, compilation_cache_dir)
        except BaseException:
            for h in handles:
                ray.kill(h)
            spg.shutdown()
            raise
        if join_world:
            registry.register(sl)
            logger.info("slice %s ready: %d chip workers in %.1fs", sl.name, len(workers),
                        time.monotonic() - t0)
        return sl

    @staticmethod
    def _start_workers(pg, num_bundles: int, handle_id: str, worker_cls: type | None,
                       timeout_s: float, handles: list) -> list[SliceWorker]:
        """A chip worker in every bundle of ``pg`` (their handles appended to
        ``handles`` as they start, for the caller to kill on failure), in rank order."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = ray.remote(concurrency_groups={"control": 2, "host": 4})(
            worker_cls or ChipWorker)
        names = []
        for bundle in range(num_bundles):
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
                ).remote(settings=settings_env())
            )
            names.append(name)
        infos = _get([h.get_info.remote() for h in handles], timeout_s,
                     "starting chip workers")
        order = rank_order(infos)
        slice_names = {i.slice_name for i in infos}
        if len(slice_names) != 1:
            raise RuntimeError(
                f"chip workers of one reservation landed on several slices {slice_names}; "
                f"this is a placement bug, please report it"
            )
        return [SliceWorker(r, infos[i], names[i], handles[i], bundle=i)
                for r, i in enumerate(order)]

    def restart_workers(self, timeout_s: float, worker_cls: type | None = None) -> None:
        """Replace every chip worker with a new process in the same bundle (same chip,
        same rank), outside any JAX world: the caller forms one (``world.form_world``).
        The old processes are killed, whatever they held is gone."""
        import ray

        if self.borrowed or self._pg is None:
            raise RuntimeError(f"slice {self.name} is lent by a service: its workers "
                               f"are the lender's to restart")
        for w in self.workers:
            try:
                ray.kill(w.handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
        handles: list = []
        try:
            workers = self._start_workers(self._pg, len(self.workers), uuid.uuid4().hex[:8],
                                          worker_cls, timeout_s, handles)
        except BaseException:
            for h in handles:
                ray.kill(h)
            raise
        before = {w.bundle: w.rank for w in self.workers}
        if any(before[w.bundle] != w.rank for w in workers):
            for h in handles:
                ray.kill(h)
            raise RuntimeError(f"slice {self.name}: restarted chip workers took other "
                               f"ranks; this is a placement bug, please report it")
        self.workers = workers
        self.world = []
        self.listeners = []

    @staticmethod
    def _timeout(topo: Topology, timeout_s: float, t0: float) -> ReservationTimeout:
        return ReservationTimeout(
            f"could not reserve a {topo.describe()} slice within timeout_s={timeout_s:g} "
            f"(waited {time.monotonic() - t0:.1f}s). The cluster has:\n{_capacity()}\n"
            f"Release a slice, add hosts of pod type {topo.pod_type}, or wait longer with "
            f"timeout_s= (or ${TIMEOUTS['reserve'].env})."
        )

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
        """Each worker with ``"ok"``, ``"dead"`` or ``"unresponsive"``, as soon as known.

        Ray reports the actors of a killed process dead 1-1.5 s after it dies (a ping
        hangs until then: most of the time from a lost host to the next step, when the
        controller named the hosts that way). A killed worker's command listener
        (``listeners``, once a controller opened its streams) refuses a connection at
        once, and a lost machine's stays silent: those workers are dead now. Only when
        every listener answers (a frozen or hung worker, whose kernel still accepts)
        are they pinged through Ray, which tells the frozen ones apart."""
        if self.listeners:
            up = listening(self.listeners, LISTEN_S)
            if not all(up):
                return [(w, "ok" if ok else "dead") for w, ok in zip(self.workers, up,
                                                                      strict=True)]
        return ping_all(self.workers, timeout_s)

    def _call_all(self, method: str, args: list[tuple], timeout_s: float) -> list:
        refs = [getattr(w.handle, method).remote(*a) for w, a in zip(self.workers, args,
                                                                      strict=True)]
        return _get(refs, timeout_s, f"{method} on slice {self.name}", workers=self.workers)

    def sidecars(self, timeout_s: float | None = None) -> list[SidecarInfo]:
        """The sidecar of every host (by TPU worker id), started on first use: one
        Python process per host, in the host's first chip's bundle (its spare CPU), on
        the same Ray node as the host's chip workers."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pathways_ray.chips.sidecar_host import SidecarHost

        with self._sidecar_lock:
            if self._sidecars is not None:
                return self._sidecars
            if self._closed:
                raise RuntimeError(f"slice {self.name} is released")
            hosts: dict[int, list[SliceWorker]] = {}
            for w in self.workers:
                hosts.setdefault(w.info.worker_id, []).append(w)
            cls = ray.remote(max_concurrency=8, max_restarts=0)(SidecarHost)
            started = []
            for wid, ws in sorted(hosts.items()):
                handle = cls.options(
                    name=f"{ws[0].actor_name}-sidecar", namespace=NAMESPACE, num_cpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=ws[0].bundle),
                ).remote(self.name, wid, len(hosts), [w.rank for w in ws],
                         settings=settings_env())
                started.append(SidecarInfo(wid, tuple(w.rank for w in ws), handle))
            try:
                boundary.get([s.handle.ping.remote() for s in started],
                             timeout=timeout_s or "worker_start",
                             what=f"starting the sidecars of slice {self.name}",
                             died=lambda e: WorkerDied(f"a sidecar of slice {self.name} died "
                                                       f"as it started: {e}"))
            except BaseException:
                for s in started:
                    ray.kill(s.handle)
                raise
            self._sidecars = started
            logger.info("slice %s: %d sidecars started", self.name, len(started))
            return started

    def shutdown(self, lost: bool = False) -> None:
        """Stop the workers and release the slice. ``lost=True``: the slice's JAX world
        is broken (a worker or host died), so the survivors are killed without leaving
        it (``jax.distributed.shutdown`` would abort them, or wait for the dead)."""
        if self._closed:
            return
        self._closed = True
        import ray

        if not ray.is_initialized():
            return
        if self.borrowed:  # the lender cleans the chips (bind) and keeps the reservation
            with self._sidecar_lock:
                sidecars, self._sidecars = self._sidecars or [], []
            for h in [s.handle for s in sidecars] + ([w.handle for w in self.workers]
                                                      if lost else []):
                try:
                    ray.kill(h)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            return
        if not lost:
            # A world with a dead or frozen member cannot be left together: waiting for it
            # would only run out the shutdown deadline (30 s, seen in a test's teardown).
            lost = any(h != "ok" for _, h in self.health(2.0))
        if not lost:
            # Leave the JAX world together first: killing the coordinator's rank while the
            # others still poll it makes them abort with fatal-error logs.
            late = boundary.settle([w.handle.shutdown_world.remote() for w in self.workers],
                                   "shutdown")
            if late:
                logger.info("slice %s: %d chip workers did not leave the JAX world in time",
                            self.name, late)
        with self._sidecar_lock:
            sidecars, self._sidecars = self._sidecars or [], []
        for h in [w.handle for w in self.workers] + [s.handle for s in sidecars]:
            try:
                ray.kill(h)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._spg.shutdown()
        registry.unregister(self.name)

    @property
    def placement_group_ids(self) -> list[str]:
        """The placement groups holding this slice (hex ids): what anyone must remove to
        free it if this object's owner dies (they live as long as the Ray job)."""
        if self._spg is None:  # borrowed: the lender holds them
            return []
        pgs = [self._spg.slice_placement_group, *self._spg.head_placement_groups]
        return [pg.id.hex() for pg in pgs if pg is not None]

    def __enter__(self) -> Slice:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Slice({self.name!r}, {self.topology.describe()})"
