"""Runtime failures. Misuse raises the built-in ``ValueError``/``TypeError`` at the
public call; everything that goes wrong at run time derives from ``PathwaysError``.

Two channels that never mix: ``RemoteError`` is the user's program raising on a
chip (the chip lives on and the slice stays usable); the ``PathwaysError``
family is the platform failing (a process, a host, a slice, a deadline). Ray's
own exceptions become these in one place, ``pathways_ray/boundary.py``.
"""

from __future__ import annotations

__all__ = [
    "ControllerDied",
    "FleetError",
    "LeaseRevoked",
    "PathwaysError",
    "RemoteError",
    "ReservationTimeout",
    "SliceLost",
    "WaitTimeout",
    "WorkerDied",
]


class PathwaysError(RuntimeError):
    """Base of every runtime failure raised by pathways-ray."""


class FleetError(PathwaysError):
    """An emulated fleet could not start, or a host process misbehaved."""


class WaitTimeout(PathwaysError, TimeoutError):
    """A wait ran past its deadline; the message names the setting that bounds it."""


class ReservationTimeout(WaitTimeout):
    """A slice could not be reserved before its deadline."""


class WorkerDied(PathwaysError):
    """A chip worker's process died (its host was lost or it crashed)."""


class ControllerDied(PathwaysError):
    """The controller actor is gone: the client cannot run anything more."""


class LeaseRevoked(ControllerDied):
    """This client's lease on a shared service ended without it closing: it sent no
    heartbeat in time (the process was frozen or cut off), or the service stopped. Its
    slices went back to the pool and another lease may hold them now; connect again."""


class SliceLost(PathwaysError):
    """A slice can no longer run programs: one of its hosts or workers is gone.

    ``slice`` names it, ``hosts`` the TPU hosts (``"<slice>/<worker id>"``) found
    dead or unresponsive, ``reason`` what was seen first. The arrays that lived
    only on that slice are gone with it; other slices are not affected.
    """

    def __init__(self, slice: str, hosts: tuple[str, ...] = (), reason: str = ""):
        self.slice = slice
        self.hosts = tuple(hosts)
        self.reason = reason
        shown = ", ".join(self.hosts[:8]) + (f" and {len(self.hosts) - 8} more"
                                             if len(self.hosts) > 8 else "")
        where = f" (host {shown})" if self.hosts else ""
        super().__init__(f"slice {slice} was lost{where}: {reason or 'a chip worker died'}. "
                         f"Its arrays are gone; other slices keep running.")

    def __reduce__(self):
        return (SliceLost, (self.slice, self.hosts, self.reason))


class RemoteError(RuntimeError):
    """A command failed on a chip worker; carries the remote traceback.

    The user's program (or its inputs) raised: the chip and its slice stay usable.
    """

    def __init__(self, command: str, remote_traceback: str):
        self.command = command
        self.remote_traceback = remote_traceback
        super().__init__(f"{command} failed on the slice:\n{remote_traceback}")

    def __reduce__(self):
        return (RemoteError, (self.command, self.remote_traceback))
