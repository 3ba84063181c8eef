"""pathways-ray: a Pathways-style single-controller runtime for TPU fleets, on Ray.

The names a user needs, loaded on first use (PEP 562): importing the package
imports neither Ray nor JAX, so its pure modules (``pathways_ray.clusters.topology``,
``pathways_ray.errors``, ...) work where Ray is not installed. Everything else
lives in its module (``pathways_ray.controller.controller.Controller``, ...).
"""

from __future__ import annotations

import importlib

from pathways_ray.clusters.topology import Topology
from pathways_ray.errors import (
    ControllerDied,
    FleetError,
    LeaseRevoked,  # noqa: F401 - pathways_ray.LeaseRevoked; a ControllerDied, so not in __all__
    PathwaysError,
    RemoteError,
    ReservationTimeout,
    SliceLost,
    WaitTimeout,
    WorkerDied,
)

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "connect": "pathways_ray.client.connect",
    "reshard": "pathways_ray.client.connect",
    "Client": "pathways_ray.client.client",
    "RemoteArray": "pathways_ray.client.arrays",
    "Fleet": "pathways_ray.clusters.fleet",
    "LocalFleet": "pathways_ray.emulation.local_fleet",
    "cluster_or_local": "pathways_ray.emulation.local_fleet",
    "Slice": "pathways_ray.chips.slice",
    "Host": "pathways_ray.chips.sidecar_host",
    "HostArray": "pathways_ray.chips.sidecar_host",
    "HostFeed": "pathways_ray.elastic.feed",
}
# Names of earlier releases, still served from their modules; not in __all__.
_MOVED = {
    "ChipWorker": "pathways_ray.chips.chip_worker",
    "Compiled": "pathways_ray.client.jit",
    "Controller": "pathways_ray.controller.controller",
    "Generation": "pathways_ray.clusters.topology",
    "HostView": "pathways_ray.clusters.cluster",
    "JitFunction": "pathways_ray.client.jit",
    "Program": "pathways_ray.programs.program",
    "SliceView": "pathways_ray.clusters.cluster",
    "SliceWorker": "pathways_ray.chips.handles",
}

__all__ = [
    "Client",
    "ControllerDied",
    "Fleet",
    "FleetError",
    "Host",
    "HostArray",
    "HostFeed",
    "LocalFleet",
    "PathwaysError",
    "RemoteArray",
    "RemoteError",
    "ReservationTimeout",
    "Slice",
    "SliceLost",
    "Topology",
    "WaitTimeout",
    "WorkerDied",
    "cluster_or_local",
    "connect",
    "reshard",
]


def __getattr__(name: str):
    module = _LAZY.get(name) or _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'pathways_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_MOVED))
