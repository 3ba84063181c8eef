"""The actor on one TPU chip.

A ``ChipWorker`` owns one XLA device: one TPU chip on TPUs, one XLA CPU device
on the emulated fleet. The workers of a slice form one JAX world
(``jax.distributed``; collectives over ICI on TPUs, over gloo on CPU). It holds
no policy and runs no user Python: the controller tells it what to do.

This module is the actor's state and its command stream; its JAX world
(``world``) and the shards it hands over, stages and pulls (``shards``) are
pieces of their own, mixed in.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import ray

from pathways_ray.chips.executor import Executor
from pathways_ray.chips.shards import CarriedBuffers, Shards
from pathways_ray.chips.worker_env import (
    ChipInfo,
)
from pathways_ray.chips.world import JaxWorld
from pathways_ray.clusters.host_plan import detect_platform
from pathways_ray.config import timeout_s
from pathways_ray.errors import LeaseRevoked
from pathways_ray.transport.commands import Inline, Put, position
from pathways_ray.transport.pull import Transfers
from pathways_ray.transport.server import ChannelServer

logger = logging.getLogger(__name__)


class ChipWorker(JaxWorld, Shards, CarriedBuffers):
    """One chip. Create it with ``ray.remote(ChipWorker)`` and ``resources={"TPU": 1}``."""

    def __init__(self, slice_name: str | None = None, settings: dict | None = None):
        os.environ.update(settings or {})  # its controller's (config.settings_env)
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

    def _run_batch(self, batch: list) -> None:
        """Run a batch of the command stream; first start the pulls of its puts that
        carry them (a cross-slice reshard's: ``Controller.transfer``), all at once."""
        inline = {cmd.buffer: cmd.pieces[position(cmd.start, self.executor.rank)] for cmd in batch
                  if isinstance(cmd, Put) and cmd.pieces is not None
                  and not isinstance(cmd.pieces, Inline)}  # (the executor reads those)
        if inline:
            sources = {p[0].source for pieces in inline.values() for p in pieces}
            self._stage(inline, sources.pop() if len(sources) == 1 else None)
        self.executor.run(batch)

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
