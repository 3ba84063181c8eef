"""``pathways_ray.connect()``: start a controller for some slices (or a lease of a
shared service) and return a ``Client``."""

from __future__ import annotations

import logging
import os

from pathways_ray import config
from pathways_ray.client.arrays import RemoteArray
from pathways_ray.client.client import Client

logger = logging.getLogger(__name__)

__all__ = ["connect", "reshard"]


def connect(slices: list | dict | None = None, *, service: str | None = None,
            lease_timeout_s: float | None = None, reserve_timeout_s: float | None = None,
            max_batch: int = 64, compilation_cache_dir: str | None = "default",
            multislice: bool = False, controller_cls: type | None = None,
            fanout: int | None = None, simulated=None) -> Client:
    """Start a controller holding ``slices`` (default: every free slice) and return a client.

    With ``service="team"``, lease the slices from that shared service instead
    (``pathways-ray service start``): ``slices`` maps shapes to counts,
    ``{"v6e-2x2": 1}`` (pathwaysutils' ``{"tpuv6e:2x2": 1}`` works too). The client
    waits in the service's queue while they are busy, for at most
    ``lease_timeout_s`` (default ``$PATHWAYS_RAY_LEASE_TIMEOUT_S`` or 600 s), and
    keeps the lease alive with heartbeats; ``close()`` gives the slices back, and so
    does the service if the process dies or its heartbeats stop for
    ``$PATHWAYS_RAY_HEARTBEAT_TIMEOUT_S`` (30 s, the service's setting).

    A process not yet connected to a Ray cluster (a ``LocalFleet``, or
    ``Fleet.attach()``) connects to ``$RAY_ADDRESS``, as ``ray.init()`` does.
    ``reserve_timeout_s`` bounds each slice's reservation
    (default ``$PATHWAYS_RAY_RESERVE_TIMEOUT_S`` or 120 s). ``compilation_cache_dir``
    is JAX's persistent compilation cache on every chip (``None`` turns it off).
    ``multislice=True`` joins the slices' chips in one JAX world, so that a mesh can
    span slices (``client.mesh(..., slices=[0, 1])``, collectives over DCN); each
    slice still runs its own programs too. The joined world is lost with any one
    slice. ``controller_cls`` replaces ``Controller`` (tests and benchmarks use
    ``pathways_ray.testing.DebugController``). ``fanout`` is how many hosts each host
    relays a slice's command stream to (default ``$PATHWAYS_RAY_FANOUT`` or 8; 0: the
    controller sends to every chip itself). ``simulated`` (a ``simulate.SimFleet``,
    whose ``connect()`` passes it) runs the controller on simulated chips.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pathways_ray.controller.controller import Controller

    if fanout is not None:
        from pathways_ray.transport.fanout import check_fanout

        check_fanout(fanout)
    if not ray.is_initialized():
        _attach_from_env()
    grant = heartbeat = None
    if service is not None:
        from pathways_ray.service import leasing as shared

        if multislice:
            raise ValueError("multislice=True with service=: a lease's slices are separate "
                             "JAX worlds; connect without service= for one world")
        if slices is None:
            raise ValueError(f"slices=None with service={service!r}: say what to lease, e.g. "
                             f"slices={{'v6e-2x2': 1}}")
        grant = shared.lease(service, slices, timeout=lease_timeout_s)
        heartbeat = shared.Heartbeat(grant)
        specs = None
    elif simulated is not None:  # running already, lent like a lease's (simulate.py)
        grant, specs = {"token": None, "slices": simulated.lend()}, None
    elif isinstance(slices, dict):
        raise TypeError(f"slices={slices!r}: shapes with counts are for a shared service's "
                        f"lease (service=...); for a private controller pass a list of shapes")
    else:
        specs = None if slices is None else list(slices)  # Topology or "v6e-4x4" strings
    if compilation_cache_dir == "default":
        compilation_cache_dir = config.default_compilation_cache_dir()
    # The controller runs beside its client (as Ray Train's controller runs beside the
    # driver): off the TPU hosts, whose CPUs and memory belong to the chips, and one
    # local hop from the client that feeds it every step.
    # Hard affinity: with soft=True Ray placed it on a TPU host in 1 of 4 tries here.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    try:
        # The client's settings (timeouts, directories) hold for its controller and its
        # chips: they travel as an argument (config.settings_env), not as a runtime_env.
        options = dict(num_cpus=0, max_restarts=0, scheduling_strategy=here)
        actor = ray.remote(**options)(controller_cls or Controller).remote(
            specs, reserve_timeout_s, compilation_cache_dir=compilation_cache_dir,
            multislice=multislice, lease=grant, fanout=fanout,
            settings=config.settings_env())
    except BaseException:
        if heartbeat is not None:
            heartbeat.release()
        raise
    try:
        return Client(actor, max_batch=max_batch, lease=heartbeat)
    except BaseException:
        ray.kill(actor)
        if heartbeat is not None:
            heartbeat.release()
        raise


def reshard(x: RemoteArray, sharding, slice: str | int | None = None) -> RemoteArray:
    """Move ``x`` to another sharding on its slice, or onto another slice."""
    return x._client.reshard(x, sharding, slice)


def _attach_from_env() -> None:
    """Connect to the cluster at ``$RAY_ADDRESS`` (with Ray's token settings from the
    environment), as ``ray.init()`` and Ray Train do; with none set, say how to connect."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        raise RuntimeError("not connected to a Ray cluster and $RAY_ADDRESS is not set; set "
                           "the exports `pathways-ray up` prints, start a "
                           "pathways_ray.LocalFleet, or call pathways_ray.Fleet.attach(address)")
    from pathways_ray.clusters.fleet import Fleet

    logger.info("connecting to the Ray cluster at %s ($RAY_ADDRESS)", address)
    Fleet.attach(address)
