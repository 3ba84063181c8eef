"""pathways-ray: a Pathways-style single-controller runtime for TPU fleets, on Ray.

Public names only; implementation lives in the modules.
"""

from pathways_ray.chip_worker import ChipWorker
from pathways_ray.client import Client, Compiled, JitFunction, RemoteArray, connect, reshard
from pathways_ray.cluster import HostView, SliceView
from pathways_ray.controller import Controller
from pathways_ray.errors import (
    FleetError,
    PathwaysError,
    ReservationTimeout,
    SliceLost,
    WorkerDied,
)
from pathways_ray.executor import RemoteError
from pathways_ray.fleet import Fleet, LocalFleet, cluster_or_local
from pathways_ray.program import Program
from pathways_ray.slice import Slice, SliceWorker
from pathways_ray.topology import Generation, Topology

__version__ = "0.1.0"

__all__ = [
    "ChipWorker",
    "Client",
    "Compiled",
    "Controller",
    "JitFunction",
    "Program",
    "RemoteArray",
    "RemoteError",
    "cluster_or_local",
    "connect",
    "reshard",
    "Fleet",
    "FleetError",
    "Generation",
    "HostView",
    "LocalFleet",
    "PathwaysError",
    "ReservationTimeout",
    "Slice",
    "SliceLost",
    "SliceView",
    "SliceWorker",
    "Topology",
    "WorkerDied",
]
