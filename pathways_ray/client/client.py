"""What user code holds: ``pathways_ray.connect()`` returns a ``Client``.

The client traces and exports functions (``client.jit``, ``jit.py``), allocates
array handles itself (``arrays.py``; a call returns at once, before anything
ran) and queues commands per slice (``dispatch.py``). Every call to the
controller, and every wait for a chip worker's result, goes through
``boundary.py``: what reaches user code is ``SliceLost`` (naming the slice and
host), ``ControllerDied``, ``WaitTimeout`` (naming the setting) or the user's
own ``RemoteError``, never a raw Ray exception.

``connect`` (``connect.py``) starts the controller and returns the client; waiting
for results (``results.py``) and resharding (``resharding.py``) are pieces of
their own, mixed in.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import numpy as np

from pathways_ray import boundary, config
from pathways_ray.client.arrays import RemoteArray, SliceInfo, memory_of, spec_of
from pathways_ray.client.dispatch import Dispatcher
from pathways_ray.client.jit import Compiled, JitFunction
from pathways_ray.client.resharding import Resharding
from pathways_ray.client.results import Results
from pathways_ray.errors import ControllerDied, PathwaysError, SliceLost
from pathways_ray.observability.profile_trace import Event
from pathways_ray.observability.profiling import PROFILE_ENV
from pathways_ray.programs.program import Program
from pathways_ray.programs.sharding import MeshShape, shard_slices, unique_shards
from pathways_ray.transport.commands import Compile, Put, Run, put_pieces

logger = logging.getLogger(__name__)

__all__ = ["Client", "Compiled", "JitFunction", "RemoteArray", "SliceInfo"]


class Client(Results, Resharding):
    """The single-controller client. Make one with ``pathways_ray.connect()``."""

    def __init__(self, controller, max_batch: int = 64, flush_interval_s: float = 0.010,
                 start_timeout_s: float | None = None, lease=None):
        self._controller = controller
        self._lease = lease  # service.Heartbeat of a shared service's lease, or None
        # What holds each slice (placement group ids), so the client can free it when the
        # controller is gone: they live as long as the Ray job, not as the controller.
        self._pg_ids: dict[str, list[str]] = {}
        # Reserving every slice and starting its workers, each step bounded on the
        # controller by its own setting; this is the backstop over all of them.
        timeout = start_timeout_s or 4 * (config.timeout_s("reserve")
                                          + config.timeout_s("worker_start"))
        described = self._call("start", timeout=timeout)
        self.slices = [SliceInfo(d["name"], d["topology"], d["chips"], d["platform"])
                       for d in described]
        self._pg_ids.update((d["name"], d["placement_groups"]) for d in described)
        self._chips = {s.name: s.chips for s in self.slices}
        self._platforms = {s.name: s.platform for s in self.slices}
        self._groups: dict[str, SliceInfo] = {}  # multislice placements, by name
        self._joint = any(d.get("joint") for d in described)  # one JAX world over them
        self._ids = itertools.count(1)
        self._registered: set[str] = set()
        self._closed = False
        self._keeper = None  # the host-memory snapshot keeper, started on first use
        self._ready_polls: dict[tuple[str, int], list] = {}  # is_ready's open queries
        # What this client sent and received itself: array bytes it put in the object
        # store (device_put), bytes it fetched and in how many reads, its sidecar calls.
        self.counters = {"put_bytes": 0, "fetched_bytes": 0, "fetches": 0, "sidecar_calls": 0}
        self._queue = Dispatcher(controller, [s.name for s in self.slices],
                                 max_batch=max_batch, flush_interval_s=flush_interval_s,
                                 died=self._controller_died)
        if lease is not None:
            lease.attach(controller)  # the service ends the lease if the controller dies
        self._spans = None  # the client's spans while a profile runs (profiling.py)
        self._session_profile = None
        if os.environ.get(PROFILE_ENV):  # pathways-ray profile -- ...: the whole session
            from pathways_ray.observability.profiling import Profile

            self._session_profile = Profile(self, os.environ[PROFILE_ENV]).start()

    def describe(self) -> list[dict]:
        """What the controller holds now, slice by slice: ``name``, ``topology``,
        ``chips``, ``platform`` ("tpu", or "cpu" on the emulated fleet) and ``workers``,
        each ``(rank, TPU worker id, chip)`` in rank order."""
        return [{k: v for k, v in d.items() if k != "placement_groups"}
                for d in self._call("describe")]

    @property
    def lease(self) -> str | None:
        """The id of this client's lease of a shared service (None: a private client)."""
        return None if self._lease is None else self._lease.lease_id

    def _controller_died(self, e: BaseException) -> ControllerDied:
        """The controller is gone: free the slices it held (its chip workers died with
        it, its placement groups did not) and say how to go on. A leased client's
        controller dies when the service takes the lease back: say that."""
        if self._lease is not None:
            revoked = self._lease.check_now()
            self._lease.release()
            if revoked is not None:
                return revoked
        self._release_slices()
        return ControllerDied(f"the controller is gone ({type(e).__name__}: {e}); the slices "
                              f"it held are released. Start a new client with "
                              f"pathways_ray.connect()")

    def _release_slices(self) -> None:
        """Remove the placement groups of this client's slices, and their records for
        ``pathways-ray status``; once (later calls find nothing left)."""
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        from pathways_ray.clusters import registry

        pg_ids, self._pg_ids = self._pg_ids, {}
        for name, ids in pg_ids.items():
            for pg_id in ids:
                try:
                    remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
                except Exception:  # noqa: BLE001 - already removed
                    logger.debug("placement group %s of %s already gone", pg_id, name)
            registry.unregister(name)

    @property
    def max_batch(self) -> int:
        return self._queue.max_batch

    def _call(self, method: str, *args, timeout: str | float = "control", where=None):
        """A call to the controller that waits for its answer. A ``SliceLost`` it raises
        is kept, so later calls on that slice raise it at once."""
        ref = getattr(self._controller, method).remote(*args)
        try:
            return boundary.get(ref, timeout=timeout, what=f"the controller's {method}",
                                died=self._controller_died)
        except SliceLost as e:
            raise self._queue.record(where or e.slice, e) from None

    def _check(self, where: str | None = None) -> None:
        if self._closed:
            raise RuntimeError("this client is closed; start another with pathways_ray.connect()")
        if self._lease is not None and self._lease.revoked is not None:
            raise self._lease.revoked
        self._queue.check(where)

    def _own(self, a: RemoteArray) -> None:
        """Refuse a handle of another client (another lease): its buffer id means
        nothing here, or worse, names one of ours."""
        if a._client is not self:
            mine, theirs = self._who(), a._client._who()
            raise ValueError(f"{a!r} belongs to {theirs}, not to this client ({mine}); arrays "
                             f"cannot pass between clients: fetch it there (np.asarray) and "
                             f"device_put it here")

    def _who(self) -> str:
        return (f"lease {self._lease.lease_id} of service {self._lease.name!r}"
                if self._lease is not None else f"the private client {id(self):#x}")

    # ---- placement -----------------------------------------------------------
    def slice(self, name_or_index: str | int | list | tuple | None = None) -> SliceInfo:
        """A slice by name or index, or a list of them: several slices of one JAX world
        (``connect(multislice=True)``), where one mesh spans their chips."""
        if name_or_index is None:
            return self.slices[0]
        if isinstance(name_or_index, (list, tuple)):
            return self._group([self.slice(x).name for x in name_or_index])
        if isinstance(name_or_index, int):
            return self.slices[name_or_index]
        for s in self.slices:
            if s.name == name_or_index:
                return s
        if name_or_index in self._groups:
            return self._groups[name_or_index]
        raise ValueError(f"slice={name_or_index!r} is not one of "
                         f"{[s.name for s in self.slices]}")

    def _group(self, names: list[str]) -> SliceInfo:
        key = "+".join(names)
        if key not in self._groups:
            # (It may re-form the slices' JAX world, starting every chip's process.)
            info = self._call("group", names, timeout="worker_start")
            g = SliceInfo(info["name"], info["topology"], info["chips"],
                          self.slice(names[0]).platform)
            self._queue.add(g.name, names)
            self._chips[g.name] = g.chips
            self._platforms[g.name] = g.platform
            self._groups[g.name] = g
        return self._groups[key]

    def mesh(self, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...],
             slices: list | None = None):
        """An abstract mesh (``jax.sharding.AbstractMesh``) over the chips of a slice, or
        over the chips of several ``slices`` (names or indices) of one JAX world, slice
        after slice: put the slice axis first, ``(len(slices), ...)``."""
        from pathways_ray.programs.program import abstract_mesh

        shape = MeshShape(tuple(axis_names), tuple(axis_sizes))  # checks
        if slices is not None:
            group = self.slice(list(slices))
            if shape.size != group.chips:
                raise ValueError(f"axis_sizes={tuple(axis_sizes)} make {shape.size} devices; "
                                 f"slices {group.name} have {group.chips} chips")
        return abstract_mesh(tuple(axis_sizes), tuple(axis_names))

    def jit(self, fn=None, *, in_shardings=None, out_shardings=None):
        """Like ``jax.jit``: ``client.jit(f)`` or ``@client.jit(out_shardings=...)``."""
        if fn is None:
            return lambda f: JitFunction(self, f, in_shardings, out_shardings)
        return JitFunction(self, fn, in_shardings, out_shardings)

    def device_put(self, x, sharding, slice: str | int | list | None = None):
        """Scatter a numpy array (or pytree of them) onto a slice's chips."""
        import jax

        target = self.slice(slice)
        leaves, treedef = jax.tree.flatten(x)
        shardings = jax.tree.leaves(sharding, is_leaf=lambda s: hasattr(s, "spec"))
        if len(shardings) == 1 and len(leaves) > 1:
            shardings = shardings * len(leaves)
        out = []
        for leaf, sh in zip(leaves, shardings, strict=True):
            host = np.asarray(leaf)  # as jax.device_put: float64 is float32 without x64
            host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
            out.append(self._put_one(host, sh, target))
        return jax.tree.unflatten(treedef, out)

    def _put_one(self, x: np.ndarray, sharding, target: SliceInfo) -> RemoteArray:
        import ray

        self._check(target.name)
        mesh, spec = spec_of(sharding, x.ndim)
        if mesh.size != target.chips:
            raise ValueError(f"the mesh {mesh.axis_names}={mesh.axis_sizes} has {mesh.size} "
                             f"devices; slice {target.name} has {target.chips} chips")
        index = shard_slices(x.shape, mesh, spec)
        pieces, size = put_pieces(x, index, unique_shards(index), mesh.size, ray.put)
        self.counters["put_bytes"] += size
        arr = RemoteArray(self, next(self._ids), target.name, x.shape, x.dtype, mesh, spec,
                          memory_of(sharding))
        self._queue.enqueue(target.name, Put(arr._id, tuple(x.shape), x.dtype.name, spec, mesh,
                                             pieces=pieces, memory=arr.memory))
        return arr

    # ---- running ------------------------------------------------------------------
    def _run(self, program: Program, out_tree, arrays: list[RemoteArray], checked=False,
             target: str | None = None):
        """Run ``program`` on ``arrays`` where they are (on ``target``, for a program
        without arguments)."""
        import jax

        for a in arrays:
            if a._client is not self:
                self._own(a)
        target = target or arrays[0].slice
        self._check_platform(program, target)
        if not checked:  # JitFunction matched the signature already; Compiled must check
            program.check_args([a.signature for a in arrays], self._chips[target])
        if program.fingerprint not in self._registered:
            self._controller.register_program.remote(program.fingerprint, program.blob)
            self._registered.add(program.fingerprint)
        outs = [RemoteArray(self, next(self._ids), target, sig.shape, sig.dtype,
                            sig.mesh or program.mesh, sig.spec) for sig in program.out_sigs]
        t0 = time.time_ns() if self._spans is not None else 0
        self._queue.enqueue(target, Run(program.fingerprint, tuple(a._id for a in arrays),
                                        tuple(o._id for o in outs)))
        if self._spans is not None:
            self._spans.append(Event("calls", program.fun_name, t0, time.time_ns() - t0,
                                     {"slice": target}))
        return jax.tree.unflatten(out_tree, outs)

    def platform(self, slice_name: str) -> str:
        """The platform of a slice's chips: "tpu", or "cpu" on the emulated fleet."""
        return self._platforms.get(slice_name) or self.slice(slice_name).platform

    def _check_platform(self, program: Program, target: str) -> None:
        if program.platform is not None and program.platform != self.platform(target):
            raise ValueError(f"{program.fun_name} was exported for {program.platform}; slice "
                             f"{target} runs {self.platform(target)}: lower it for that slice "
                             f"(client.jit exports for its arguments' slice)")

    def profile(self, log_dir: str | os.PathLike | None = None):
        """Record one trace of everything this client runs, across every chip (a context
        manager): ``with client.profile("/tmp/prof") as prof: ...``; then
        ``prof.paths`` has a ``.perfetto.json.gz`` (ui.perfetto.dev) and an ``.xplane.pb``
        (``tensorboard --logdir``/XProf). Default directory: ``$PATHWAYS_RAY_DIR/profiles``."""
        from pathways_ray.observability.profiling import Profile

        self._check()
        return Profile(self, log_dir)

    def _compile(self, program: Program, target: str) -> RemoteArray:
        """Ship ``program`` to ``target`` and compile it there without running it;
        returns the status buffer (ready once every chip compiled)."""
        self._check(target)
        if program.mesh.size != self._chips[target]:
            raise ValueError(f"{program.fun_name} was exported for {program.mesh.size} chips; "
                             f"slice {target} has {self._chips[target]} chips")
        self._check_platform(program, target)
        if program.fingerprint not in self._registered:
            self._controller.register_program.remote(program.fingerprint, program.blob)
            self._registered.add(program.fingerprint)
        status = RemoteArray(self, next(self._ids), target, (), "int32", program.mesh, ())
        sigs = tuple((s.shape, s.dtype, s.spec) for s in program.in_sigs)
        self._queue.enqueue(target, Compile(program.fingerprint, sigs, status._id,
                                            program.mesh))
        return status

    # ---- sidecars (sidecar.py) -------------------------------------------------------
    def sidecar(self, target, *, slice: str | int | None = None):
        """Run ``target`` (a function or a class) on every host of ``slice``, next to its
        chips: see ``pathways_ray.client.sidecar``. Starts the slice's sidecars on first use."""
        from pathways_ray.client import sidecar

        info = self.slice(slice)
        self._check(info.name)
        if info.name in self._groups:
            raise ValueError(f"slice={slice!r} spans several slices; a sidecar runs on the "
                             f"hosts of one slice")
        self._call("sidecars", info.name, timeout="worker_start", where=info.name)
        return sidecar.make(self, target, info.name)

    def _host_call(self, target: str, spec: dict, args: tuple, kwargs: dict, out):
        from pathways_ray.client.sidecar import HostResults, build_call

        self._check(target)
        call, handles = build_call(self, target, spec, args, kwargs, out)
        self._queue.enqueue(target, call)
        self.counters["sidecar_calls"] += 1
        if out is not None:
            return handles
        return HostResults(self, target, call.reply, spec["name"])

    def _host_results(self, target: str, reply: int, timeout_s: float | None, what: str):
        self._sync(target)
        refs = self._call("host_results", reply, where=target)
        return self._worker_results(target, refs, timeout_s, what)

    def _free(self, slice_name: str, buffer_id: int) -> None:
        self._ready_polls.pop((slice_name, buffer_id), None)
        if not self._closed:
            self._queue.free(slice_name, buffer_id)

    def flush(self) -> None:
        """Send every queued command now."""
        self._check()
        self._queue.flush()

    def _sync(self, where: str) -> None:
        """Before a call that needs results: send what is queued for ``where`` and raise
        what is known to have failed."""
        self._check(where)
        self._queue.flush_one(where)
        self._queue.poll()
        self._queue.check(where)

    # ---- results --------------------------------------------------------------------

    # ---- growing -------------------------------------------------------------------
    def request_slices(self, count: int) -> None:
        """Ask the controller for ``count`` more slices like the ones it lost; it reserves
        them in the background as capacity appears (``refresh_slices`` lists them)."""
        self._call("grow", count)

    def refresh_slices(self) -> list[str]:
        """Slices the controller added since the last look (a replacement reserved in the
        background); they join ``client.slices``."""
        known = {s.name for s in self.slices}
        added = []
        for d in self._call("describe"):
            if d["name"] not in known:
                info = SliceInfo(d["name"], d["topology"], d["chips"], d["platform"])
                self._pg_ids[info.name] = d["placement_groups"]
                self._queue.add(info.name, [info.name])
                self._chips[info.name] = info.chips
                self._platforms[info.name] = info.platform
                self.slices.append(info)
                added.append(info.name)
        return added

    def stats(self) -> dict:
        self.flush()
        self._call("drain", timeout="stream")
        return self._call("stats")

    def close(self) -> None:
        """Release every slice and stop the controller (prompt even if a slice was lost
        or the controller died)."""
        import ray

        if self._closed:
            return
        if self._session_profile is not None:  # pathways-ray profile: the whole session
            prof, self._session_profile = self._session_profile, None
            try:
                prof.stop()
            except PathwaysError as e:
                logger.warning("the session's profile was not written: %s", e)
        self._closed = True
        self._queue.close()
        try:
            boundary.get(self._controller.shutdown.remote(), timeout="shutdown",
                         what="closing the controller", died=self._controller_died)
        except PathwaysError as e:
            logger.info("closing the client: %s", e)
            self._release_slices()  # the controller did not finish: nothing stays held
        finally:
            ray.kill(self._controller)
            if self._keeper is not None:
                ray.kill(self._keeper)
            if self._lease is not None:  # after the controller is gone: nothing races it
                self._lease.release()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
