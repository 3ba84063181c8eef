"""Starting, finding and stopping shared services: what ``pathways-ray service`` calls."""

from __future__ import annotations

import logging
import os

from pathways_ray import boundary
from pathways_ray.clusters.topology import Topology
from pathways_ray.config import NAMESPACE, timeout_s
from pathways_ray.errors import LeaseRevoked
from pathways_ray.service.service import _ACTOR_PREFIX, Service, _actor_name

__all__ = ["get_service", "list_services", "service_status", "start_service", "stop_service"]

logger = logging.getLogger(__name__)


def start_service(name: str, slices: list | None = None, *,
                  reserve_timeout_s: float | None = None,
                  compilation_cache_dir: str | None = "default") -> dict:
    """Start service ``name`` (a detached actor that outlives this process) holding
    ``slices`` (default: every free slice); returns its status. The process must be
    connected to the Ray cluster."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pathways_ray import config

    _check_name(name)
    if not ray.is_initialized():
        raise RuntimeError("not connected to a Ray cluster; start a pathways_ray.LocalFleet "
                           "or call pathways_ray.Fleet.attach(address) first")
    if name in list_services():
        raise ValueError(f"name={name!r}: a service of that name is running; stop it with "
                         f"`pathways-ray service stop --name {name}` or pick another name")
    if compilation_cache_dir == "default":
        compilation_cache_dir = config.default_compilation_cache_dir()
    env = {"env_vars": {"RAY_IGNORE_UNHANDLED_ERRORS": "1",
                        **{k: v for k, v in os.environ.items() if k.startswith("PATHWAYS_RAY_")}}}
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(Service).options(
        name=_actor_name(name), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
        max_concurrency=64, max_restarts=0, runtime_env=env, scheduling_strategy=here,
    ).remote(name, None if slices is None else [str(Topology.of(s)) for s in slices],
             reserve_timeout_s, compilation_cache_dir)
    budget = 4 * (timeout_s("reserve") + timeout_s("worker_start"))
    try:
        return boundary.get(actor.start.remote(), timeout=budget,
                            what=f"starting service {name!r}")
    except BaseException:
        _kill(actor, name)
        raise


def get_service(name: str):
    import ray

    _check_name(name)
    try:
        return ray.get_actor(_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        running = list_services()
        raise ValueError(f"service={name!r}: no such service in this cluster (running: "
                         f"{running or 'none'}); start it with `pathways-ray service start "
                         f"--name {name}`") from None


def list_services() -> list[str]:
    from ray.util import list_named_actors

    return sorted(a["name"][len(_ACTOR_PREFIX):] for a in list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(_ACTOR_PREFIX))


def service_status(name: str) -> dict:
    return boundary.get(get_service(name).status.remote(), timeout="control",
                        what=f"the status of service {name!r}", died=_gone(name))


def stop_service(name: str) -> dict:
    """End every lease, release every slice and process of service ``name``."""
    actor = get_service(name)
    try:
        return boundary.get(actor.stop.remote(), timeout=2 * timeout_s("shutdown"),
                            what=f"stopping service {name!r}", died=_gone(name))
    finally:
        _kill(actor, name)


def _kill(actor, name: str) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - gone already
        logger.debug("service %s already gone", name)


def _gone(name: str):
    return lambda e: LeaseRevoked(f"the service {name!r} is gone ({boundary.death_summary(e)})")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"service={name!r} must be a non-empty name of letters, digits, '-' "
                         f"and '_'")


