"""A chip worker's JAX world: one ``jax.distributed`` process per chip, the slice's
chips its devices, and what every new world prepares once; and forming one world
over the chips of one or several slices (``form_world``, from the driver side).

``jax.distributed.initialize`` starts a world's coordination service in process 0,
on a chip: when that chip's host dies every other process of the world aborts
within ~0.3 s (measured), so one lost slice takes the others with it. A world of
several slices is elastic only if its service outlives any slice. ``WorldService``
runs it in the process that owns the world (the controller, off every TPU host),
*recoverable* (JAX's ``jax_enable_recoverability``: a task that fails does not fail
the others), and the chips join it as clients only (``JaxWorld.init_world(...,
service_outside=True)``).

Measured with JAX 0.12.1 on the emulated fleet (gloo): after a slice's processes are
killed the survivors stay up, and a program over the survivors' devices alone runs
at once (its collectives are a new gloo clique of those devices). A process that
comes back under a dead one's id cannot take part again: the survivors keep the
clique they had with its predecessor, and its rendezvous keys are taken; a world
that takes a slice back is a new world (``Controller``'s regrowth).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np

from pathways_ray.chips.executor import Executor
from pathways_ray.chips.handles import _get
from pathways_ray.chips.worker_env import (
    cpu_env,
    drop_stdout_lines,
    network_proxy_vars,
    one_cpu_while,
    tpu_multiprocess_env,
    wait_listening,
)
from pathways_ray.programs import compile_cache

logger = logging.getLogger(__name__)


class JaxWorld:
    """Mixin of ``ChipWorker``: joining, using and leaving the slice's JAX world."""

    def init_world(
        self,
        *,
        coordinator: str,
        num_processes: int,
        rank: int,
        timeout_s: float,
        process_addresses: list[str] | None = None,
        slice_shape: tuple[int, ...] | None = None,
        compilation_cache_dir: str | None = None,
        slice_devices: tuple[int, int] | None = None,
        multislice: tuple[int, int, str] | None = None,
        service_outside: bool = False,
    ) -> dict:
        """Join a JAX world as process ``rank``; returns what JAX sees.

        The world is the slice's, or several slices' (``slice_devices`` = this
        slice's (first device, count) in it; ``multislice`` = (slice id, slices,
        DCN coordinator) on TPU). ``service_outside``: the world's coordination
        service runs elsewhere (``WorldService``) and every chip, rank
        0's too, joins it as a client, so that no slice's loss ends the others.
        """
        start, count = slice_devices or (0, num_processes)
        if self.info.platform == "cpu":
            env = cpu_env(os.environ)
            drop_stdout_lines()  # gloo's "[Gloo] Rank N is connected to ..." on every chip
        else:
            env = tpu_multiprocess_env(
                rank=rank - start, chip=self.info.chip,
                process_addresses=process_addresses or [], slice_shape=slice_shape or (),
                multislice=multislice,
            )
        for key, value in env.items():
            if value == "":
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        t0 = time.monotonic()
        import jax

        if self.info.platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if compilation_cache_dir:
            # XLA executables persist across runs: the second run of a program loads it.
            jax.config.update("jax_compilation_cache_dir", compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
            if self.info.platform == "cpu":
                _cache_writes_from_every_process()
                _cache_keys_of_one_slice(self.info.slice_name)
            self._cache_counter = compile_cache.count_events(
                compilation_cache_dir, f"{self.info.slice_name}-{rank}-{os.getpid()}")
        if not network_proxy_vars(os.environ):  # JAX's warning would name Ray Serve's
            jax.config.update("jax_check_proxy_envs", False)
        if rank != 0 or service_outside:  # see wait_listening: ~1 s of every world's start
            wait_listening(coordinator, t0 + timeout_s)
        if service_outside:
            _join_as_client(coordinator, num_processes, rank,
                            int(max(1, t0 + timeout_s - time.monotonic())))
        else:
            jax.distributed.initialize(
                coordinator_address=coordinator,
                num_processes=num_processes,
                process_id=rank,
                initialization_timeout=int(max(1, t0 + timeout_s - time.monotonic())),
            )
        from jax.sharding import Mesh

        if self.info.platform == "cpu":
            with one_cpu_while():  # XLA's CPU client: one compute thread per chip
                jax.devices()
        self.rank = rank
        self._mesh = Mesh(np.array(jax.devices()[start:start + count]), ("chips",))
        self.executor = Executor(rank, pieces=self._take_pieces, give=self._give)
        # Off the first step's path: the one-time set-up of calling exported programs
        threading.Thread(target=_prepare_exported_calls, name="prepare-exported",
                         daemon=True).start()
        local = jax.local_devices()
        if len(local) != 1:
            raise RuntimeError(
                f"chip worker rank {rank} sees {len(local)} local devices, expected 1; "
                f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}"
            )
        return {
            "rank": rank,
            "process_index": jax.process_index(),
            "device_count": jax.device_count(),
            "local_device": str(local[0]),
            "device_id": int(local[0].id),  # its id in the world (re-forming renames them)
            "platform": local[0].platform,
            "init_s": time.monotonic() - t0,
        }

    def all_reduce(self, value) -> np.ndarray:
        """Sum ``value`` over every chip of the slice with one XLA collective.

        Every worker of the slice must call this with the same shape and dtype.
        """
        if self._mesh is None:
            raise RuntimeError("init_world() has not run on this chip worker")
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        x = np.asarray(value)
        key = (x.shape, x.dtype.str)
        if key not in self._reducers:
            self._reducers[key] = jax.jit(
                lambda a: a.sum(axis=0), out_shardings=NamedSharding(self._mesh, P())
            )
        n = self._mesh.size
        local = jax.device_put(x[None], jax.local_devices()[0])
        global_x = jax.make_array_from_single_device_arrays(
            (n, *x.shape), NamedSharding(self._mesh, P("chips")), [local]
        )
        out = self._reducers[key](global_x)
        return np.asarray(out.addressable_data(0))

    def shutdown_world(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._mesh is not None:
            import jax

            jax.distributed.shutdown()
            self._mesh = None


def _join_as_client(coordinator: str, num_processes: int, rank: int, timeout_s: int) -> None:
    """What ``jax.distributed.initialize`` does for process ``rank``, less starting the
    coordination service (which it does in process 0): the world's service runs off the
    chips. JAX internals (``distributed.global_state``): the backends read the client,
    process id and count from there."""
    from jax._src import distributed
    from jax._src.lib import _jax

    state = distributed.global_state
    if state.client is not None:
        raise RuntimeError("this chip worker joined a JAX world already")
    state.coordinator_address = coordinator
    state.process_id = rank
    state.num_processes = num_processes
    state.client = _jax.get_distributed_runtime_client(
        coordinator, rank, init_timeout=timeout_s, use_compression=True)
    state.client.connect()


def _prepare_exported_calls() -> None:
    """Lower one tiny exported program, so the first real one does not pay JAX's
    one-time set-up of calling exported programs.

    Every program reaches a chip exported (``jax.export``), and the first lowering of
    one in a process initializes the platform's FFI handlers; on CPU that imports
    SciPy's LAPACK (0.16 s of CPU per chip worker, measured), in the first step of
    every new slice, cached or not. Run in a thread once the JAX world exists; the
    first program, if it comes sooner, waits on the same import lock, no longer.
    """
    try:
        import jax
        from jax import export

        spec = jax.ShapeDtypeStruct((), np.float32)
        exp = export.deserialize(export.export(jax.jit(lambda x: x))(spec).serialize())
        jax.jit(exp.call).lower(spec)
    except Exception:  # noqa: BLE001 - only speed depends on it
        logger.debug("preparing exported calls failed", exc_info=True)


def _cache_keys_of_one_slice(slice_name: str) -> None:
    """Keep an emulated slice's persistent compilation cache entries its own.

    On a CPU world each rank computes a key of its own (``_cache_writes_from_every_
    process``), and the same rank of two slices the same key: two slices compiling
    one program at once each load some of their entries from the other's writes.
    With JAX 0.12.1 a slice whose chips mixed loaded and freshly compiled executables
    could hang in its first gloo all-reduce (every chip waiting in ``gloo::allreduce``,
    seen with gdb): 1 run in 5 on this 2-core machine under load, 0 in 16 with the cache
    off, 0 in 14 with JAX 0.10.2; CI met it as a 300 s fetch timeout. A suffix of the
    slice's name on every key keeps each slice to its own entries (the same slice of a
    later run still hits them). JAX internals, like the writer above.
    """
    import hashlib

    try:
        from jax._src import compilation_cache
    except ImportError:
        return
    get = getattr(compilation_cache, "get_cache_key", None)
    if get is None or getattr(get, "_pathways_ray", False):
        return
    tag = hashlib.sha256(slice_name.encode()).hexdigest()[:8]

    def get_cache_key(*args, **kwargs) -> str:
        return f"{get(*args, **kwargs)}-{tag}"

    get_cache_key._pathways_ray = True
    compilation_cache.get_cache_key = get_cache_key


def _cache_writes_from_every_process() -> None:
    """Let every process of a CPU world write its persistent compilation cache entries.

    JAX writes entries only from process 0 (on TPU every host computes the same key,
    so one writer is enough). On a multi-process CPU world each process computes a
    key of its own (measured: four ranks, four keys for one program), so ranks 1..n
    never found an entry and compiled every program again on every new slice (4.2 s
    for the demo's gradient program, against 0.6 s on rank 0). Keys differ, so the
    writers never contend for one file. JAX internals: if they move, nothing changes
    but the speed.
    """
    try:
        from jax._src import compilation_cache, compiler
    except ImportError:
        return
    if getattr(compiler._cache_write, "_pathways_ray", False) or not hasattr(
            compilation_cache, "put_executable_and_time"):
        return

    def write(cache_key, compile_time_secs, module_name, backend, executable,
              host_callbacks=()):  # (JAX < 0.11 passes host_callbacks, later ones do not)
        if host_callbacks:
            return
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable,
                                                      backend, int(compile_time_secs))
        except Exception:  # noqa: BLE001 - a cache write must never fail a program
            logger.info("writing compilation cache entry %s failed", module_name,
                        exc_info=True)

    write._pathways_ray = True
    compiler._cache_write = write


class WorldService:
    """A recoverable JAX coordination service for ``num_processes`` chips, on this host."""

    def __init__(self, num_processes: int, *, heartbeat_timeout_s: int = 100,
                 shutdown_timeout_s: int = 5):
        import ray
        from jax._src.lib import _jax

        self.num_processes = num_processes
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        self._service = _jax.get_distributed_runtime_service(
            f"[::]:{port}", num_processes, heartbeat_timeout=heartbeat_timeout_s,
            shutdown_timeout=shutdown_timeout_s, recoverable=True)
        self.address = f"{ray.util.get_node_ip_address()}:{port}"
        logger.info("JAX world service for %d chips at %s", num_processes, self.address)

    def shutdown(self) -> None:
        if self._service is not None:
            try:
                self._service.shutdown()
            finally:
                self._service = None


def form_world(slices: list, timeout_s: float, compilation_cache_dir: str | None,
               elastic: bool = False) -> None:
    """One JAX world over the chips of ``slices``, slice after slice in rank order.
    On the emulated fleet a world of several slices (or any, ``elastic``: one that is
    to take slices in later) has its coordination service here (``WorldService``)."""
    workers = [w for sl in slices for w in sl.workers]
    ports = _get([w.handle.reserve_port.remote() for w in workers], timeout_s,
                 "reserving ports")
    addresses = [f"{w.info.ip}:{p}" for w, p in zip(workers, ports, strict=True)]
    coordinator = addresses[0]
    outside = ((elastic or len(slices) > 1)
               and all(w.info.platform == "cpu" for w in workers))
    if outside:
        service = WorldService(len(workers))
        coordinator = service.address
        for sl in slices:
            sl.world_service = service
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
                service_outside=outside,
            ))
        sl.world_offset = offset
        offset += n
    world = _get(refs, timeout_s + 30, "initializing the JAX world")
    for info in world:
        if info["device_count"] != len(workers):
            raise RuntimeError(
                f"rank {info['rank']} sees {info['device_count']} devices, the world has "
                f"{len(workers)} chips"
            )
    for sl in slices:
        sl.world = world[sl.world_offset:sl.world_offset + sl.num_chips]
