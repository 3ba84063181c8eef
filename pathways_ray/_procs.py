"""Finding and stopping the processes an emulated fleet started, and the ports it takes.

Each ``ray start`` is launched as the leader of a new session, so every
process it starts — GCS, raylet, agents, Ray workers, chip actors — stays in
that session (Unix session id = the ``ray start`` pid), even after it is
re-parented to init. A fleet records its session ids and stops everything in
them. As a second net, every process also carries ``PATHWAYS_RAY_FLEET=<id>``
(and ``PATHWAYS_RAY_HOST=<slice>/<worker>``) in its environment; that catches
a process that started a session of its own. The environment alone is not
enough: processes that rename themselves with ``setproctitle`` (Ray's
dashboard and runtime-env agents) overwrite it.

Every selection names its fleet (``find(fleet_id, ...)``): the host tag
``<slice>/<worker>`` repeats in every fleet (two fleets of 2x2 slices both have a
host ``v6e-2x2-1/0``), so a host is selected by its tag *and* its fleet's id, or by
the host's own sessions; a process that says it belongs to another fleet is never
selected, whatever its session.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import signal
import socket
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import psutil

from pathways_ray.errors import FleetError

FLEET_ENV = "PATHWAYS_RAY_FLEET"
HOST_ENV = "PATHWAYS_RAY_HOST"

logger = logging.getLogger(__name__)


def _looks_like_ray(proc: psutil.Process) -> bool:
    try:
        text = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "ray" in text.lower() or "gcs_server" in text


def _belongs(proc: psutil.Process, fleet_id: str, host: str | None,
             sessions: set[int]) -> bool:
    """Whether ``proc`` is one of fleet ``fleet_id``'s (of its host ``host``, if given)."""
    env = proc.environ()
    tagged = env.get(FLEET_ENV)
    if tagged is not None and tagged != fleet_id:
        return False  # another fleet's, even in a session id that pid reuse made equal
    if tagged == fleet_id and (host is None or env.get(HOST_ENV) == host):
        return True
    # Renamed processes (setproctitle) lose their environment: their session says it.
    return bool(sessions) and os.getsid(proc.pid) in sessions and _looks_like_ray(proc)


def find(fleet_id: str, sessions: Collection[int] = (), *,
         host: str | None = None) -> list[psutil.Process]:
    """Live processes of fleet ``fleet_id`` (only host ``host``'s, "<slice>/<worker>",
    when given): tagged with the fleet's id (and the host), or in one of ``sessions``
    (the fleet's, or the host's, ``ray start`` sessions) with a Ray-looking command
    line. A process tagged with another fleet's id is never selected.
    """
    if not fleet_id:
        raise ValueError("fleet_id='' selects no fleet: a process is selected by its "
                         "fleet's id (a host's tag repeats in every fleet)")
    me = os.getpid()
    sessions = set(sessions)
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if _belongs(proc, fleet_id, host, sessions):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess,
                ProcessLookupError, PermissionError):
            continue
    return found


# Ray's own daemons: on SIGTERM a raylet drains for ~11 s and the GCS does not exit at
# all (measured, Ray 2.60); they hold nothing a stop would lose, so they get no grace.
_DAEMONS = ("/ray/core/src/ray/", "ray::RuntimeEnvAgent", "ray::DashboardAgent",
            "ray/dashboard/", "ray/autoscaler/", "ray/_private/log_monitor.py",
            "ray.util.client.server")


def _is_daemon(proc: psutil.Process) -> bool:
    try:
        text = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(d in text for d in _DAEMONS)


def kill(procs: list[psutil.Process], *, grace_s: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to all; wait up to ``grace_s`` for those running user code (Ray
    workers, actors, drivers) to exit, then SIGKILL whatever is left, daemons included."""
    workers = [p for p in procs if not _is_daemon(p)]
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(workers, timeout=grace_s)
    alive = [p for p in procs if p.is_running()]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5)
    for p in alive:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:  # dead; its parent has not reaped it
                continue
        except psutil.NoSuchProcess:
            continue
        logger.warning("process %s survived SIGKILL", p.pid)


def kill_all(fleet_id: str, sessions: Collection[int] = (), *, host: str | None = None,
             grace_s: float, sig: int = signal.SIGTERM) -> int:
    """Stop every process ``find`` selects, until none is left.

    Repeats because a dying raylet may still spawn a worker in the meantime.
    Returns how many processes were stopped.
    """
    total = 0
    for _ in range(5):
        procs = find(fleet_id, sessions, host=host)
        if not procs:
            break
        total += len(procs)
        kill(procs, grace_s=grace_s, sig=sig)
    return total


def wait_gone(fleet_id: str, sessions: Collection[int] = (), *, host: str | None = None,
              timeout_s: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = find(fleet_id, sessions, host=host)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports handed out on this machine, by any process of this user: two fleets starting
# at once (two `pathways-ray up`, two test processes) each probe before Ray binds, so
# both could find the same port free. A port stays taken here for PORT_HOLD_S.
PORT_HOLD_S = 600.0


def _port_registry() -> Path:
    return Path(tempfile.gettempdir()) / f"pathways-ray-ports-{os.getuid()}"


def free_ports(n: int, exclude: Collection[int] = ()) -> list[int]:
    """``n`` different free TCP ports, all reserved together.

    Picked one by one with a bind-to-0 probe, two could come back equal (each is
    released before the next probe) and Ray refuses to start ("port ... used by
    other components"). Here every candidate stays bound until all ``n`` are
    found, and they come from below the kernel's ephemeral range, which is where
    Ray's own components get their OS-chosen ports, so those cannot take them
    either. ``exclude`` holds ports already handed out to the same fleet; ports
    another process of this user took in the last ``PORT_HOLD_S`` seconds (a file
    in the temp dir, under a lock) are skipped too, so fleets starting at once do
    not collide before Ray binds what they probed.
    """
    try:
        registry = open(_port_registry(), "a+")  # noqa: SIM115 - held for the lock
    except OSError as e:  # e.g. a read-only temp dir: probe alone
        logger.debug("no port registry (%s); probing without it", e)
        return _probe_ports(n, exclude)
    with registry:
        fcntl.flock(registry, fcntl.LOCK_EX)
        registry.seek(0)
        now, taken = time.time(), {}
        for line in registry.read().split():
            port, _, at = line.partition("@")
            try:
                if now - float(at) < PORT_HOLD_S:
                    taken[int(port)] = at
            except ValueError:
                continue  # a torn line from a crash: ignore it
        ports = _probe_ports(n, {*exclude, *taken})
        taken.update({p: f"{now:.0f}" for p in ports})
        registry.seek(0)
        registry.truncate()
        registry.write("".join(f"{p}@{at}\n" for p, at in taken.items()))
        return ports


def _probe_ports(n: int, exclude: Collection[int]) -> list[int]:
    low = min(_ephemeral_low(), 65536) - 1
    candidates = list(set(range(max(1024, low - 12000), low)) - set(exclude))
    random.shuffle(candidates)
    held: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:
                s.close()
                continue
            held.append(s)
            if len(held) == n:
                return [h.getsockname()[1] for h in held]
        raise FleetError(f"found only {len(held)} of {n} free TCP ports below {low}")
    finally:
        for h in held:
            h.close()
