"""Fault injection on a local emulated fleet: kill, freeze and restore TPU hosts for
real (signals to every process of the host), for tests, demos and users rehearsing
failures. ``LocalFleet.remove_host`` / ``freeze_host`` / ``restore_host`` / ``host_cpu_s``
call these.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

from pathways_ray import _procs
from pathways_ray.errors import FleetError

if TYPE_CHECKING:
    from pathways_ray.emulation.local_fleet import LocalFleet

__all__ = ["freeze_host", "host_cpu_s", "kill_host", "restore_host"]

logger = logging.getLogger(__name__)


def kill_host(fleet: LocalFleet, slice_name: str, worker_id: int,
              timeout_s: float = 30.0) -> str:
    """Kill one emulated host as a VM loss would: SIGKILL to its raylet and every
    process on it, then wait until Ray marks the node dead. Returns its node id.

    Every process is stopped (SIGSTOP) before any is killed: a lost VM takes all of
    them at once, so none may see another die and react (Ray's agents would publish
    the raylet's last log lines to every driver as an unexpected crash)."""
    plan = fleet._plan(slice_name, worker_id)
    node_id = fleet.node_ids.get(plan.key, "")
    _signal(_procs.find(_procs.HOST_ENV, plan.key, fleet._host_sessions(plan.key)),
            _procs.signal.SIGSTOP)
    killed = _procs.kill_all(_procs.HOST_ENV, plan.key, fleet._host_sessions(plan.key),
                             grace_s=0, sig=_procs.signal.SIGKILL)
    if not killed:
        raise FleetError(f"host {plan.key} has no running processes; was it already removed?")
    logger.warning("removed emulated host %s (node %s, %d processes)", plan.key,
                   node_id[:8], killed)
    if fleet.connect and node_id:
        fleet.wait_node(node_id, alive=False, timeout_s=timeout_s)
    return node_id


def freeze_host(fleet: LocalFleet, slice_name: str, worker_id: int,
                frozen: bool = True) -> int:
    """SIGSTOP every process of one emulated host (a hung VM: its sockets stay open,
    nothing answers); ``frozen=False`` sends SIGCONT. Returns how many processes.
    Ray marks a host frozen for more than ~5 s dead, and its raylet exits when it
    wakes: ``kill_host`` and ``fleet.restore_host`` it afterwards."""
    plan = fleet._plan(slice_name, worker_id)
    procs = _procs.find(_procs.HOST_ENV, plan.key, fleet._host_sessions(plan.key))
    if not procs:
        raise FleetError(f"host {plan.key} has no running processes")
    _signal(procs, _procs.signal.SIGSTOP if frozen else _procs.signal.SIGCONT)
    logger.warning("%s emulated host %s (%d processes)", "froze" if frozen else "thawed",
                   plan.key, len(procs))
    return len(procs)


def _signal(procs: list, sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except _procs.psutil.NoSuchProcess:
            pass


def restore_host(fleet: LocalFleet, slice_name: str, worker_id: int,
                 timeout_s: float = 60.0) -> str:
    """Start a fresh raylet for a removed host (a replacement VM). Returns its node id
    (empty from a handle that is not connected, e.g. ``LocalFleet.running()``)."""
    plan = fleet._plan(slice_name, worker_id)
    if _procs.find(_procs.HOST_ENV, plan.key, fleet._host_sessions(plan.key)):
        raise FleetError(f"host {plan.key} is still running; remove_host() it first")
    i = fleet.hosts.index(plan)
    for attempt in (1, 2):
        fleet._port_pool = fleet._take_ports(4)
        proc = fleet._spawn(f"host{i}-{uuid.uuid4().hex[:4]}", plan.key,
                           plan.start_args(fleet.address),
                           {**plan.env, _procs.HOST_ENV: plan.key})
        try:
            fleet._wait_started([(plan.key, proc)], time.monotonic(), timeout_s=timeout_s)
            break
        except FleetError as e:
            # `ray start` gives a raylet 30 s (fixed) to register; a loaded machine
            # can miss that once. Clear what it left and start it again.
            _procs.kill_all(_procs.HOST_ENV, plan.key, fleet._host_sessions(plan.key),
                            grace_s=0, sig=_procs.signal.SIGKILL)
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            logger.warning("host %s did not register in time; starting it again",
                           plan.key)
    if fleet.connect:
        fleet._wait_registered(time.monotonic(), timeout_s=timeout_s)
    return fleet.node_ids.get(plan.key, "")


def host_cpu_s(fleet: LocalFleet, slice_name: str, worker_id: int) -> float:
    """CPU-seconds used so far by the live processes of one emulated host (its
    raylet, Ray's agents, its workers): what the host costs this machine's cores."""
    import psutil

    plan = fleet._plan(slice_name, worker_id)
    total = 0.0
    for proc in _procs.find(_procs.HOST_ENV, plan.key, fleet._host_sessions(plan.key)):
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system
    return total
