"""Reserved slices, recorded in Ray's KV store for ``pathways-ray status`` in other
processes: who holds which slice, and the health of its chip workers."""

from __future__ import annotations

import json
import logging
import os
import time

from pathways_ray import boundary
from pathways_ray.config import NAMESPACE

__all__ = ["list_registered_slices", "register", "unregister"]

logger = logging.getLogger(__name__)

_KV_PREFIX = "pathways-ray/slice/"


def register(sl) -> None:
    """Record a reserved ``Slice`` (its name, shape, owner and workers)."""
    from ray.experimental import internal_kv

    record = {
        "name": sl.name,
        "topology": str(sl.topology),
        "chips_per_host": sl.topology.chips_per_host,
        "owner_pid": os.getpid(),
        "created": time.time(),
        "workers": [
            {"rank": w.rank, "worker_id": w.info.worker_id, "chip": w.info.chip,
             "node_id": w.info.node_id, "actor": w.actor_name}
            for w in sl.workers
        ],
    }
    internal_kv._internal_kv_put(_KV_PREFIX + sl.name, json.dumps(record),
                                 overwrite=True, namespace=NAMESPACE)


def unregister(name: str) -> None:
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_del(_KV_PREFIX + name, namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - the cluster may be going away
        logger.debug("could not remove registry entry of %s", name, exc_info=True)


def list_registered_slices() -> list[dict]:
    """Slices reserved by any process of this cluster, with their workers' health."""
    import ray
    from ray.experimental import internal_kv

    records = []
    for key in internal_kv._internal_kv_list(_KV_PREFIX, namespace=NAMESPACE):
        raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw:
            records.append(json.loads(raw))
    pairs = []
    for rec in records:
        for w in rec["workers"]:
            try:
                handle = ray.get_actor(w["actor"], namespace=NAMESPACE)
            except ValueError:
                w["health"] = "gone"
                continue
            pairs.append((w, handle))
    for w, state in boundary.health(pairs, 3.0):
        w["health"] = state
    live = []
    for rec in records:
        if all(w["health"] in ("gone", "dead") for w in rec["workers"]):
            # Its owner exited without shutdown() (killed): the actors died with it.
            internal_kv._internal_kv_del(_KV_PREFIX + rec["name"], namespace=NAMESPACE)
        else:
            live.append(rec)
    return sorted(live, key=lambda r: r["name"])
