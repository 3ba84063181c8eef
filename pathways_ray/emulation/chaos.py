"""Fault injection on a local emulated fleet: kill, freeze and restore TPU hosts for
real (signals to every process of the host), for tests, demos and users rehearsing
failures. ``LocalFleet.remove_host`` / ``freeze_host`` / ``restore_host`` / ``host_cpu_s``
call these (``HostFaults``, a mixin of ``LocalFleet``).

Every process is selected by its fleet's id as well as its host (``_procs.find``):
host names repeat across fleets, and a fault meant for one never reaches another.
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

__all__ = ["HostFaults", "freeze_host", "host_cpu_s", "kill_host", "restore_host"]

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
    _signal(fleet.host_processes(slice_name, worker_id), _procs.signal.SIGSTOP)
    killed = _procs.kill_all(**fleet._host_selector(plan.key), grace_s=0,
                             sig=_procs.signal.SIGKILL)
    if not killed:
        raise FleetError(f"host {plan.key} of fleet {fleet.name!r} has no running processes; "
                         f"was it already removed?")
    logger.warning("removed emulated host %s of fleet %s (node %s, %d processes)", plan.key,
                   fleet.name, node_id[:8], killed)
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
    procs = fleet.host_processes(slice_name, worker_id)
    if not procs:
        raise FleetError(f"host {plan.key} of fleet {fleet.name!r} has no running processes")
    _signal(procs, _procs.signal.SIGSTOP if frozen else _procs.signal.SIGCONT)
    logger.warning("%s emulated host %s of fleet %s (%d processes)",
                   "froze" if frozen else "thawed", plan.key, fleet.name, len(procs))
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
    if fleet.host_processes(slice_name, worker_id):
        raise FleetError(f"host {plan.key} of fleet {fleet.name!r} is still running; "
                         f"remove_host() it first")
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
            _procs.kill_all(**fleet._host_selector(plan.key), grace_s=0,
                            sig=_procs.signal.SIGKILL)
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

    total = 0.0
    for proc in fleet.host_processes(slice_name, worker_id):
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system
    return total


class HostFaults:
    """Mixin of ``LocalFleet``: fault injection on its own hosts (the functions above)."""

    def remove_host(self, slice_name: str, worker_id: int, timeout_s: float = 30.0) -> str:
        """Kill one emulated host as a VM loss would (``kill_host``); returns the dead
        node's id."""
        return kill_host(self, slice_name, worker_id, timeout_s=timeout_s)

    def freeze_host(self, slice_name: str, worker_id: int, frozen: bool = True) -> int:
        """SIGSTOP (``frozen=False``: SIGCONT) one emulated host (``freeze_host``)."""
        return freeze_host(self, slice_name, worker_id, frozen=frozen)

    def restore_host(self, slice_name: str, worker_id: int, timeout_s: float = 60.0) -> str:
        """Start a fresh raylet for a removed host (a replacement VM): its node id, or ""
        from a handle that is not connected (``restore_host``)."""
        return restore_host(self, slice_name, worker_id, timeout_s=timeout_s)

    def host_processes(self, slice_name: str, worker_id: int) -> list:
        """The live processes (``psutil.Process``) of one emulated host of this fleet: its
        raylet, Ray's agents, its workers. Never another fleet's, though host names
        repeat across fleets."""
        return _procs.find(**self._host_selector(self._plan(slice_name, worker_id).key))

    def host_cpu_s(self, slice_name: str, worker_id: int) -> float:
        """CPU-seconds used so far by the live processes of one emulated host (its
        raylet, Ray's agents, its workers): what the host costs this machine's cores."""
        return host_cpu_s(self, slice_name, worker_id)
