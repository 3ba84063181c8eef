"""The actor on one TPU chip.

A ``ChipWorker`` owns one XLA device: one TPU chip on TPUs, one XLA CPU device
on the emulated fleet. The workers of a slice form one JAX world
(``jax.distributed``; collectives over ICI on TPUs, over gloo on CPU). It holds
no policy and runs no user Python: the controller tells it what to do.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import ray

from pathways_ray import boundary
from pathways_ray.chips.executor import Executor
from pathways_ray.chips.worker_env import (
    ChipInfo,
    cpu_env,
    network_proxy_vars,
    one_cpu_while,
    tpu_multiprocess_env,
    wait_listening,
)
from pathways_ray.clusters.host_plan import detect_platform
from pathways_ray.config import timeout_s
from pathways_ray.errors import LeaseRevoked, RemoteError, SliceLost, WaitTimeout, WorkerDied
from pathways_ray.programs import compile_cache
from pathways_ray.transport.channel import ChannelServer
from pathways_ray.transport.commands import Put
from pathways_ray.transport.pull import Pull, PullFailed, Transfers
from pathways_ray.transport.pull import wait as wait_pulled

logger = logging.getLogger(__name__)


class ChipWorker:
    """One chip. Create it with ``ray.remote(ChipWorker)`` and ``resources={"TPU": 1}``."""

    def __init__(self, slice_name: str | None = None):
        ctx = ray.get_runtime_context()
        chips = ctx.get_accelerator_ids().get("TPU") or []
        if len(chips) != 1:
            raise RuntimeError(
                f"a ChipWorker must hold exactly one TPU chip, Ray assigned {chips!r}; "
                f"create it with resources={{'TPU': 1}}"
            )
        self.info = ChipInfo(
            slice_name=os.environ.get("TPU_NAME") or slice_name or "",
            worker_id=int(os.environ.get("TPU_WORKER_ID", "0") or 0),
            chip=int(chips[0]),
            node_id=ctx.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            platform=detect_platform(),
        )
        self.rank: int | None = None
        self._mesh = None
        self._reducers: dict = {}
        self.executor: Executor | None = None
        self._channel: ChannelServer | None = None
        # buffer id -> (this chip's (ref, index) pieces, the slice they come from or None)
        self._staged: dict[int, tuple[list, str | None]] = {}
        # A staged object holding several buffers' pieces (a packet of a cross-slice
        # transfer) is read once: ref -> [its value once read, puts still to read it].
        self._packets: dict = {}
        self._transfers = Transfers(self.info.ip)  # chip-to-chip pulls (pull.py)
        self._arrived: set = set()  # pulls in _packets whose bytes are all here
        self._lost_sources: set[str] = set()  # slices the controller lost (abandon)
        self._cancelled: dict[int, BaseException] = {}  # pull id -> why it never comes
        self._staged_cond = threading.Condition()
        self._held: dict[int, object] = {}  # token -> shards (or the error) for a sidecar
        self._cache_counter = None  # this process's compilation cache lookups
        # The lease of a shared service this chip is lent to (None: a private controller
        # owns it). Every call that reads or stages data presents it; see bind().
        self._lease: str | None = None

    # ---- placement ---------------------------------------------------------
    @ray.method(concurrency_group="control")
    def get_info(self) -> ChipInfo:
        return self.info

    @ray.method(concurrency_group="control")
    def reserve_port(self) -> int:
        """A free TCP port on this host (for the JAX coordinator or libtpu)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return -1 if self.rank is None else self.rank

    # ---- the JAX world -------------------------------------------------------
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
    ) -> dict:
        """Join a JAX world as process ``rank``; returns what JAX sees.

        The world is the slice's, or several slices' (``slice_devices`` = this
        slice's (first device, count) in it; ``multislice`` = (slice id, slices,
        DCN coordinator) on TPU).
        """
        start, count = slice_devices or (0, num_processes)
        if self.info.platform == "cpu":
            env = cpu_env(os.environ)
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
            self._cache_counter = compile_cache.count_events(
                compilation_cache_dir, f"{self.info.slice_name}-{rank}-{os.getpid()}")
        if not network_proxy_vars(os.environ):  # JAX's warning would name Ray Serve's
            jax.config.update("jax_check_proxy_envs", False)
        if rank != 0:  # see wait_listening: saves ~1 s of every world's start
            wait_listening(coordinator, t0 + timeout_s)
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

    # ---- programs and arrays (see executor.py) -------------------------------------
    # ---- leases of a shared service (service.py) ----------------------------------
    @ray.method(concurrency_group="control")
    def bind(self, lease: str | None) -> None:
        """Lend this chip to ``lease`` (or give it back to the pool): close the command
        stream of whoever held it, then drop every buffer, program, staged piece and
        held shard it left. From now on only calls presenting ``lease`` are served, so
        a controller whose lease ended (its client froze and was reclaimed) can
        neither run on this chip nor read what the next lease puts here."""
        self._lease = lease
        if self._channel is not None:
            self._channel.close(join_s=timeout_s("control") / 6)
            self._channel = None
        with self._staged_cond:
            self._staged.clear()
            self._packets.clear()
            self._arrived.clear()
            self._lost_sources.clear()
            self._cancelled.clear()
            self._held.clear()
            self._staged_cond.notify_all()
        if self.executor is not None:
            self.executor.clear()

    def _check_lease(self, lease: str | None) -> None:
        if lease != self._lease:
            raise LeaseRevoked(f"chip rank {self.rank} of slice {self.info.slice_name} is not "
                               f"lent to the lease this call presents (its lease ended: the "
                               f"client closed, or sent no heartbeat in time); connect again")

    @ray.method(concurrency_group="control")
    def open_channel(self, lease: str | None = None) -> tuple[tuple[str, int], bytes]:
        """Listen for the controller's command stream; returns (address, secret)."""
        if self.executor is None:
            raise RuntimeError("init_world() has not run on this chip worker")
        self._check_lease(lease)
        if self._channel is None:
            self._channel = ChannelServer(self.info.ip, self._run_batch)
        return self._channel.address, self._channel.token

    @ray.method(concurrency_group="control")
    def relay(self, children: list[tuple[int, tuple[str, int], bytes]],
              lease: str | None = None) -> None:
        """Forward the command stream to ``children`` (``fanout.relay_tree``): their
        ``(rank, address, secret)`` from ``open_channel``."""
        self._check_lease(lease)
        if self._channel is None:
            raise RuntimeError("open_channel() has not run on this chip worker")
        self._channel.relay(children, f"slice {self.info.slice_name}", timeout_s("stream"))

    @ray.method(concurrency_group="control")
    def stage(self, refs: list, buffers: dict[int, list], source: str | tuple | None = None,
              lease: str | None = None) -> None:
        """Hand over, per buffer id, the pieces a later ``put`` in the stream assembles
        this chip's shard from: ``(k, index)`` or ``(k, index, position)`` with ``k``
        the position in ``refs`` of the object holding it: a Ray object ref (refs
        travel by Ray call so Ray tracks who holds them; each once, however many
        pieces it holds: the borrowing bookkeeping is per ref) or a ``Pull`` from
        another chip. ``source`` names the slice they come from
        (a cross-slice reshard), or the ``(slice, host)`` of the sidecar that returns
        them."""
        self._check_lease(lease)
        self._stage({b: [(refs[p[0]], *p[1:]) for p in pieces] for b, pieces in buffers.items()},
                    source)

    def _run_batch(self, batch: list) -> None:
        """Run a batch of the command stream; first start the pulls of its puts that
        carry them (a cross-slice reshard's: ``Controller.transfer``), all at once."""
        inline = {cmd.buffer: cmd.pieces[self.executor.rank - cmd.start] for cmd in batch
                  if isinstance(cmd, Put) and cmd.pieces is not None}
        if inline:
            sources = {p[0].source for pieces in inline.values() for p in pieces}
            self._stage(inline, sources.pop() if len(sources) == 1 else None)
        self.executor.run(batch)

    def _stage(self, buffers: dict[int, list], source: str | tuple | None) -> None:
        # Start every copy now, all at once, while the stream runs what comes before
        # their puts (one by one, each put would wait for its own). Pulls from another
        # chip's transfer server (``pull.py``) land in this chip's memory, started before
        # their puts can look for them; Ray objects come to this host's store, on a
        # daemon thread: a pull from a host that died waits out its timeout without
        # holding up later pulls or this process's exit.
        refs = list(dict.fromkeys(p[0] for pieces in buffers.values() for p in pieces))
        started = {}
        for p in refs:
            if isinstance(p, Pull):
                try:
                    started[p] = self._transfers.start(p)
                except Exception as e:  # noqa: BLE001 - its put raises it, naming the source
                    started[p] = ConnectionError(f"pulling from {p.address}: {e}")
        with self._staged_cond:
            for buffer_id, pieces in buffers.items():
                self._staged[buffer_id] = (pieces, source)
                for r in {p[0] for p in pieces}:
                    self._packets.setdefault(r, [None, 0])[1] += 1
            for p, arrays in started.items():
                self._packets[p][0] = arrays
            self._staged_cond.notify_all()
        objects = [r for r in refs if not isinstance(r, Pull)]
        if objects:
            threading.Thread(target=ray.wait, args=(objects,), daemon=True, name="prefetch",
                             kwargs={"num_returns": len(objects),
                                     "timeout": timeout_s("stream"),
                                     "fetch_local": True}).start()

    @ray.method(concurrency_group="control")
    def abandon(self, slice_name: str, lease: str | None = None) -> None:
        """The controller lost slice ``slice_name``: a put waiting on a pull from it
        fails now (``SliceLost``) instead of at its deadline."""
        self._check_lease(lease)
        self._lost_sources.add(slice_name)

    @ray.method(concurrency_group="control")
    def cancel(self, pulls: list[int], error: BaseException, lease: str | None = None) -> None:
        """The offers ``pulls`` will never come (their source could not make them): a
        put waiting on one fails now, with ``error``, instead of at its deadline."""
        self._check_lease(lease)
        self._cancelled.update(dict.fromkeys(pulls, error))

    def _take_pieces(self, buffer_id: int) -> list:
        with self._staged_cond:
            if buffer_id not in self._staged and not self._staged_cond.wait_for(
                    lambda: buffer_id in self._staged, timeout=(wait_s := timeout_s("stream"))):
                raise WaitTimeout(f"the pieces of buffer {buffer_id} did not arrive within "
                                  f"{wait_s:g} s ($PATHWAYS_RAY_STREAM_TIMEOUT_S)")
            pieces, source = self._staged.pop(buffer_id)

        def died(e: BaseException):
            if isinstance(source, tuple):  # (slice, host) of the sidecar that made them
                return SliceLost(source[0], (source[1],), reason=f"its sidecar on host "
                                 f"{source[1]} died before chip rank {self.rank} read buffer "
                                 f"{buffer_id} from it ({type(e).__name__})")
            if source is None:
                return WorkerDied(f"the data of buffer {buffer_id} was lost before this chip "
                                  f"read it: {e}")
            return SliceLost(source, reason=f"it died before this chip copied buffer "
                                            f"{buffer_id} from it ({type(e).__name__})")

        # A piece is (ref, index), or (ref, index, position) in a packet of several
        # buffers' shards (a cross-slice transfer), a packet being a Ray object or the
        # arrays of a pull: each is read once, by the first put that needs it, and
        # dropped after the last.
        refs = list(dict.fromkeys(p[0] for p in pieces))
        with self._staged_cond:
            values = {r: self._packets[r][0] for r in refs
                      if self._packets.get(r, (None,))[0] is not None}
        unread = [r for r in refs if r not in values]
        try:
            for r in refs:
                if isinstance(r, Pull) and r not in self._arrived:
                    arrays = values.get(r)
                    what = f"the pieces of buffer {buffer_id} from chip {r.address}"
                    try:
                        if not isinstance(arrays, list):
                            raise arrays or ConnectionError(f"{what} were never pulled")
                        wait_pulled(arrays, timeout_s("stream"), what,
                                    stopped=lambda r=r: self._stopped(r))
                        self._arrived.add(r)
                    except TimeoutError as e:
                        raise WaitTimeout(str(e)) from None
                    except ConnectionError as e:
                        self._transfers.forget(r.address)
                        raise died(e) from None
                    except PullFailed as e:
                        raise RemoteError(f"copying buffer {buffer_id} from slice {source}",
                                          str(e)) from None
            unread = [r for r in unread if not isinstance(r, Pull)]
            if unread:
                got = boundary.get(unread, timeout="stream", died=died,
                                   what=f"the pieces of buffer {buffer_id}")
                values.update(zip(unread, got, strict=True))
                with self._staged_cond:
                    for r in unread:
                        if r in self._packets:
                            self._packets[r][0] = values[r]
            return [(p[1], values[p[0]] if len(p) == 2 else values[p[0]][p[2]])
                    for p in pieces]
        finally:
            with self._staged_cond:
                for r in refs:
                    held = self._packets.get(r)
                    if held is not None:
                        held[1] -= 1
                        if held[1] <= 0:
                            del self._packets[r]
                            self._arrived.discard(r)

    def _stopped(self, pull: Pull) -> BaseException | None:
        """Why ``pull`` will never arrive, if the controller has said so."""
        if pull.source in self._lost_sources:
            return ConnectionError(f"the controller lost slice {pull.source}")
        return self._cancelled.get(pull.uuid)

    def _give(self, token: int, value) -> None:
        with self._staged_cond:
            self._held[token] = value
            self._staged_cond.notify_all()

    @ray.method(concurrency_group="host")
    def held(self, token: int, lease: str | None = None) -> list[np.ndarray]:
        """This chip's shards that a ``Hold`` in the stream copied for a sidecar call
        (once; raises why they could not be read)."""
        self._check_lease(lease)
        wait_s = timeout_s("stream")
        with self._staged_cond:
            if not self._staged_cond.wait_for(lambda: token in self._held, timeout=wait_s):
                raise WaitTimeout(f"shards held for sidecar call {token} did not appear within "
                                  f"{wait_s:g} s ($PATHWAYS_RAY_STREAM_TIMEOUT_S)")
            value = self._held.pop(token)
        if isinstance(value, BaseException):
            raise value
        return value

    def _after(self, batches: int) -> None:
        """Wait until the first ``batches`` batches of the stream have run: a query
        sent after them must see their results."""
        if batches:
            if self._channel is None:
                raise RuntimeError("no command stream is open on this chip worker")
            self._channel.wait_for(batches, timeout_s("stream"))

    def shard(self, buffer_id: int, after: int = 0, lease: str | None = None) -> np.ndarray:
        """This chip's shard of a buffer (raises the remote error of a failed buffer)."""
        self._check_lease(lease)
        self._after(after)
        return self.executor.local_shard(buffer_id)

    def shards(self, buffer_ids: list[int], after: int = 0,
               lease: str | None = None) -> list[np.ndarray]:
        """This chip's shards of several buffers, in one object (a snapshot's share)."""
        self._check_lease(lease)
        self._after(after)
        return [self.executor.local_shard(i) for i in buffer_ids]

    def put_shards(self, packets: list[list[int]], after: int = 0,
                   lease: str | None = None) -> tuple:
        """Per packet, the list of this chip's shards of the packet's buffers, then
        ``True``: called with ``num_returns=len(packets) + 1``, so the caller holds
        the refs (and can hand them on) before this runs, each packet becomes one
        object in this host's store, and the last, tiny return tells the caller
        that every packet was made, or raises why not (a failed buffer).

        For a transfer to another slice, one packet per destination host: the caller
        passes the refs on and never holds the bytes."""
        self._check_lease(lease)
        self._after(after)
        return (*([self.executor.local_shard(i) for i in packet] for packet in packets),
                True)

    def offer(self, pulls: dict[int, list[tuple[int, tuple | None, tuple]]], after: int = 0,
              lease: str | None = None) -> bool:
        """Offer, per pull id, this chip's shards of buffers (or the parts named) to
        one pull by another chip (``pull.py``), for ``$PATHWAYS_RAY_STREAM_TIMEOUT_S``:
        ``(buffer id, part as (start, stop) per axis or None, (shape, dtype) the puller
        expects)`` each. Raises if a buffer failed, or is not what the puller expects:
        nothing is offered then."""
        self._check_lease(lease)
        self._after(after)
        wanted = [(b, part) for pieces in pulls.values() for b, part, _ in pieces]
        arrays = self.executor.local_pieces(wanted)
        for (b, _, (shape, dtype)), a in zip((p for ps in pulls.values() for p in ps), arrays,
                                             strict=True):
            if (tuple(a.shape), str(a.dtype)) != (tuple(shape), dtype):
                raise RemoteError(f"offering buffer {b} to another slice",
                                  f"its piece here is {a.dtype}{list(a.shape)}, the copy "
                                  f"expects {dtype}{list(shape)} (does the client's JAX "
                                  f"config, jax_enable_x64, differ from the chips'?)")
        arrays = iter(arrays)
        for uuid, pieces in pulls.items():
            self._transfers.offer(uuid, [next(arrays) for _ in pieces], timeout_s("stream"))
        return True

    @ray.method(concurrency_group="control")
    def transfer_address(self, lease: str | None = None) -> str:
        """Where this chip's transfer server listens (started now if it has not been)."""
        self._check_lease(lease)
        return self._transfers.address()

    def ready(self, buffer_ids: list[int], after: int = 0, lease: str | None = None) -> bool:
        """True once the buffers are computed; raises the remote error if one failed."""
        self._check_lease(lease)
        self._after(after)
        self.executor.ready(buffer_ids)
        return True

    # ---- profiling (client.profile, profile_trace.py) ------------------------------
    @ray.method(concurrency_group="control")
    def clock(self) -> int:
        """This host's wall clock (ns): the controller aligns the chips' traces by it."""
        return time.time_ns()

    @ray.method(concurrency_group="control")
    def profile(self, action: str, lease: str | None = None) -> list | None:
        """``"start"`` JAX's profiler on this chip (XLA's own events plus a span per
        command); ``"stop"`` it and return its events (``profile_trace.Event``, on this
        host's wall clock)."""
        import glob
        import shutil
        import tempfile

        import jax

        from pathways_ray.observability import profile_trace

        self._check_lease(lease)
        if action == "start":
            if getattr(self, "_profile_dir", None):
                raise RuntimeError("a profile is already running on this chip worker")
            self._profile_dir = tempfile.mkdtemp(prefix="pathways-ray-profile-")
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # every Python call: far too many events
            options.host_tracer_level = 2
            jax.profiler.start_trace(self._profile_dir, profiler_options=options)
            if self.executor is not None:
                self.executor.tracing = True
            return None
        if action != "stop":
            raise ValueError(f"action={action!r} must be 'start' or 'stop'")
        where, self._profile_dir = getattr(self, "_profile_dir", None), None
        if not where:
            raise RuntimeError("no profile is running on this chip worker")
        if self.executor is not None:
            self.executor.tracing = False
        try:
            jax.profiler.stop_trace()
            files = glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True)
            if not files:
                return []
            with open(max(files, key=os.path.getmtime), "rb") as f:
                return profile_trace.read_xspace(f.read())
        finally:
            shutil.rmtree(where, ignore_errors=True)

    @ray.method(concurrency_group="control")
    def stats(self) -> dict:
        ex = self.executor
        return {"buffers": len(ex.buffers), "programs": len(ex.programs),
                "compiled": len(ex.compiled),
                "commands": ex.commands_run, "batches": ex.batches_run,
                "first_call_s": dict(ex.first_call_s),
                "compile_cache": (self._cache_counter.counts.as_dict()
                                  if self._cache_counter else None),
                "staged": len(self._staged)} if ex else {}

    def shutdown_world(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._mesh is not None:
            import jax

            jax.distributed.shutdown()
            self._mesh = None


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

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
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
