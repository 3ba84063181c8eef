"""Finding and stopping the processes an emulated fleet started.

Every process the fleet starts carries ``PATHWAYS_RAY_FLEET=<fleet id>`` in its
environment, and every process of one emulated host also carries
``PATHWAYS_RAY_HOST=<slice>/<worker id>``. Children inherit both — raylets,
agents, Ray workers and chip actors alike — so we find every process that
belongs to a fleet or a host even after it was re-parented or moved to its own
session, and never touch another cluster's processes.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import psutil

FLEET_ENV = "PATHWAYS_RAY_FLEET"
HOST_ENV = "PATHWAYS_RAY_HOST"

logger = logging.getLogger(__name__)


def find(env_key: str, value: str) -> list[psutil.Process]:
    """Processes whose environment has ``env_key=value`` (this process excluded)."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(env_key) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill(procs: list[psutil.Process], *, grace_s: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig``; whatever is still alive after ``grace_s`` gets SIGKILL."""
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5)
    for p in alive:
        logger.warning("process %s survived SIGKILL", p.pid)


def kill_all(env_key: str, value: str, *, grace_s: float, sig: int = signal.SIGTERM) -> int:
    """Stop every process tagged ``env_key=value``; repeat until none is left.

    Repeats because a dying raylet may still spawn a worker in the meantime.
    Returns how many processes were stopped.
    """
    total = 0
    for _ in range(5):
        procs = find(env_key, value)
        if not procs:
            break
        total += len(procs)
        kill(procs, grace_s=grace_s, sig=sig)
    return total


def wait_gone(env_key: str, value: str, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = find(env_key, value)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
