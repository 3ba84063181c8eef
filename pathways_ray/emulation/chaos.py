"""Fault injection on a local emulated fleet: kill, freeze and restore TPU hosts for
real (signals to every process of the host), for tests, demos and users rehearsing
failures. ``LocalFleet.remove_host`` / ``freeze_host`` / ``restore_host`` call these.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pathways_ray import _procs
from pathways_ray.errors import FleetError

if TYPE_CHECKING:
    from pathways_ray.emulation.local_fleet import LocalFleet

__all__ = ["freeze_host", "kill_host"]

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
