"""Runtime failures. Misuse raises the built-in ``ValueError``/``TypeError`` at the
public call; everything that goes wrong at run time derives from ``PathwaysError``.
"""

from __future__ import annotations

__all__ = [
    "FleetError",
    "PathwaysError",
    "ReservationTimeout",
    "SliceLost",
    "WorkerDied",
]


class PathwaysError(RuntimeError):
    """Base of every runtime failure raised by pathways-ray."""


class FleetError(PathwaysError):
    """An emulated fleet could not start, or a host process misbehaved."""


class ReservationTimeout(PathwaysError, TimeoutError):
    """A slice could not be reserved before its deadline."""


class WorkerDied(PathwaysError):
    """A chip worker's process died (its host was lost or it crashed)."""


class SliceLost(PathwaysError):
    """A slice can no longer run programs: one of its hosts or workers is gone."""
