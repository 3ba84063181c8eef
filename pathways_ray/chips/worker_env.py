"""How chip workers are ranked and what environment each one's JAX needs.

Pure: no Ray, no JAX import. ``ChipWorker`` applies these before importing JAX.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ChipInfo", "cpu_env", "network_proxy_vars", "one_cpu_while", "rank_order",
           "tpu_multiprocess_env", "wait_listening"]

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


@dataclass(frozen=True)
class ChipInfo:
    """Where one chip worker runs, as the worker itself sees it."""

    slice_name: str
    worker_id: int  # the host's TPU worker id (TPU_WORKER_ID / ray.io/tpu-worker-id)
    chip: int  # the chip index on its host (from TPU_VISIBLE_CHIPS / Ray's TPU ids)
    node_id: str
    ip: str
    pid: int
    platform: str  # "cpu" (emulated) or "tpu"


def rank_order(infos: Sequence[ChipInfo]) -> list[int]:
    """Indices of ``infos`` in rank order: by TPU worker id, then chip index.

    Bundle order is not rank order (Ray does not promise that bundle 0 lands
    on TPU worker 0), so ranks come from what each worker reports.
    """
    seen: dict[tuple[int, int], int] = {}
    for i, info in enumerate(infos):
        key = (info.worker_id, info.chip)
        if key in seen:
            raise ValueError(
                f"two chip workers report TPU worker {info.worker_id} chip {info.chip} "
                f"(pids {infos[seen[key]].pid} and {info.pid}); each chip must have one worker"
            )
        seen[key] = i
    return [seen[k] for k in sorted(seen)]


def cpu_env(environ: Mapping[str, str], devices: int = 1) -> dict[str, str]:
    """Env for a process owning ``devices`` emulated chips: one XLA CPU device each.

    Workers inherit ``XLA_FLAGS`` from wherever they were started (a driver
    that asked for 8 fake devices would give every chip 8), so the device-count
    flag is replaced, other flags kept.
    """
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} must be a positive integer (chips owned)")
    flags = _DEVICE_COUNT_FLAG.sub("", environ.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    # Many emulated chips share the machine's cores: XLA's Eigen calls run on the
    # calling thread. (The client's own intra-op pool is sized by CPU affinity, not by
    # this flag: ChipWorker makes the client inside one_cpu_while.)
    if not any(f.startswith("--xla_cpu_multi_thread_eigen") for f in flags):
        flags.append("--xla_cpu_multi_thread_eigen=false")
    return {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(flags),
        # XLA's INFO/WARNING lines (gloo peer counts, the preemption notifier) would be
        # echoed to the driver by every chip; errors still show. The user's choice wins.
        "TF_CPP_MIN_LOG_LEVEL": environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        # Collectives between emulated chips (processes) run over gloo, as ICI would on TPU.
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }


def tpu_multiprocess_env(
    *, rank: int, chip: int, process_addresses: Sequence[str], slice_shape: Sequence[int],
    multislice: tuple[int, int, str] | None = None,
) -> dict[str, str]:
    """libtpu's multi-process variables for one process per chip.

    Ray gives a ``{"TPU": 1}`` actor ``TPU_VISIBLE_CHIPS`` and single-host
    bounds; one JAX program spanning every chip of the slice instead needs each
    process to own one chip (``TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1``) inside a
    process grid the shape of the slice, with every peer's address.

    ``rank`` and ``process_addresses`` are the slice's own (the ICI grid).
    ``multislice=(slice_id, num_slices, coordinator_ip)`` joins several slices
    in one program over DCN, with the ``MEGASCALE_*`` variables Ray's JAX
    trainer also sets.
    """
    if not 0 <= rank < len(process_addresses):
        raise ValueError(f"rank={rank} is outside 0..{len(process_addresses) - 1}")
    shape = list(slice_shape) + [1] * (3 - len(slice_shape))
    port = process_addresses[rank].rsplit(":", 1)[1]
    env = {
        "TPU_VISIBLE_CHIPS": str(chip),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": ",".join(map(str, shape)),
        "TPU_PROCESS_ADDRESSES": ",".join(process_addresses),
        "TPU_PROCESS_PORT": port,
        "CLOUD_TPU_TASK_ID": str(rank),
        # Ray's single-host bounds for a 1-chip actor contradict the grid above.
        "TPU_CHIPS_PER_HOST_BOUNDS": "",
        "TPU_HOST_BOUNDS": "",
    }
    if multislice is not None:
        slice_id, num_slices, coordinator = multislice
        if not 0 <= slice_id < num_slices:
            raise ValueError(f"multislice slice_id={slice_id} is outside 0..{num_slices - 1}")
        env.update({"MEGASCALE_COORDINATOR_ADDRESS": coordinator,
                    "MEGASCALE_NUM_SLICES": str(num_slices),
                    "MEGASCALE_SLICE_ID": str(slice_id)})
    return env


def network_proxy_vars(environ: Mapping[str, str]) -> list[str]:
    """The variables that JAX's ``distributed.initialize`` warns about as proxies (any
    name with ``_proxy``) that may really route its gRPC: not ``NO_PROXY`` (it only
    exempts hosts) nor Ray Serve's own settings (``RAY_SERVE_PROXY_USE_GRPC`` on every
    node is about Serve's HTTP proxy actor, and made every chip worker warn at every
    world's start)."""
    return sorted(k for k in environ if "_proxy" in k.lower() and k.lower() != "no_proxy"
                  and not k.upper().startswith("RAY_SERVE_"))


def wait_listening(address: str, deadline: float) -> None:
    """Return once ``address`` (host:port) accepts TCP connections, or at ``deadline``
    (``time.monotonic()``; JAX's own initialization timeout then reports it).

    Rank 0 starts the JAX coordinator inside ``jax.distributed.initialize``. A rank
    that connects before it listens is refused, and gRPC then waits out its initial
    reconnect backoff (1 s) before trying again: every rank but the coordinator's,
    since all start together. Connecting only once it listens makes the world's
    connect take ~0.1 s instead of ~1 s (4 emulated chips, one machine).
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    while (left := deadline - time.monotonic()) > 0:
        try:
            socket.create_connection((host, int(port)), timeout=min(1.0, left)).close()
            return
        except OSError:
            time.sleep(0.01)


@contextlib.contextmanager
def one_cpu_while():
    """Run the body with this thread allowed on one CPU, then allow every thread of the
    process the CPUs this thread had before (Linux; elsewhere a no-op).

    An emulated chip creates its XLA CPU client inside it: XLA sizes the client's
    intra-op thread pool by the creating thread's CPU affinity, and threads inherit it.
    With the machine's width (2 here), every chip spreads each op over a pool that
    steals and wakes across the cores the other chips need: 4 chips on 2 cores spent
    ~370 us of CPU per 1 ms all-reduce step that way, ~300 us with one thread each
    (``--xla_cpu_multi_thread_eigen=false`` does not reach the pool).
    """
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    full = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(full)})
    try:
        yield
    finally:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), full)


GLOO_CHATTER = b"[Gloo] Rank "
_stdout_filtered = False


def drop_stdout_lines(prefix: bytes = GLOO_CHATTER, *, flush_after_s: float = 0.2) -> bool:
    """Route this process's fd 1 through a pipe that drops lines starting with ``prefix``.

    Gloo prints "[Gloo] Rank N is connected to M peer ranks..." with C++ ``std::cout``
    (no log level governs it) on every process of a CPU world when its first
    collective connects, and Ray forwards each chip worker's stdout to the driver: 16
    such lines in a run of 2 x v6e 2x4. Every other line passes unchanged; a partial
    line is passed on after ``flush_after_s`` without more output, and what is left at
    exit is written out. Once per process; returns whether this call installed it.
    """
    global _stdout_filtered
    if _stdout_filtered:
        return False
    import select
    import sys

    sys.stdout.flush()
    read_end, write_end = os.pipe()
    original = os.dup(1)
    os.dup2(write_end, 1)
    os.close(write_end)
    _stdout_filtered = True

    def write(data: bytes) -> None:
        while data:
            data = data[os.write(original, data):]

    def pump() -> None:
        poller, pending = select.poll(), b""
        poller.register(read_end, select.POLLIN)
        while True:
            if not poller.poll(flush_after_s * 1000 if pending else None):
                write(pending)  # a partial line, and nothing more for a while
                pending = b""
                continue
            chunk = os.read(read_end, 65536)
            if not chunk:
                write(pending)
                return
            *lines, pending = (pending + chunk).split(b"\n")
            write(b"".join(line + b"\n" for line in lines if not line.startswith(prefix)))

    import atexit
    import threading

    thread = threading.Thread(target=pump, name="pathways-ray-stdout", daemon=True)
    thread.start()

    def restore() -> None:  # at exit: the pipe's last bytes still reach the real stdout
        sys.stdout.flush()
        os.dup2(original, 1)  # closes the pipe's only write end: the pump reads its end
        thread.join(timeout=2.0)

    atexit.register(restore)
    return True
