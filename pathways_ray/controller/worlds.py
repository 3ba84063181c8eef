"""Reserving several slices as one JAX world (``reserve_joint``): side by side, in
the names' order, the world formed by ``chips.world.form_world`` (whose coordination
service, for an emulated multislice world, runs in this process: ``WorldService``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pathways_ray.chips.world import form_world
from pathways_ray.clusters import registry
from pathways_ray.clusters.cluster import slice_order
from pathways_ray.config import TIMEOUTS

__all__ = ["reserve_joint"]

def reserve_joint(topologies: Sequence, *, timeout_s: float | None = None,
                  worker_timeout_s: float | None = None,
                  compilation_cache_dir: str | None = None,
                  worker_cls: type | None = None) -> list:
    """Reserve several slices whose chips form one JAX world (multislice).

    Each slice still runs its own programs on its own devices; a program
    over a mesh spanning them runs on all, with collectives between slices
    (DCN on TPU, gloo here). On the emulated fleet the world's coordination
    service runs in this process (``WorldService``, shared by the slices as
    ``world_service``; the caller shuts it down once they are released), so a
    lost slice leaves the others running; on TPUs the world lives and dies as
    one, as any multislice job does over DCN.
    """
    from concurrent.futures import ThreadPoolExecutor

    from pathways_ray.chips.slice import Slice

    slices: list[Slice] = []
    try:
        # Side by side: each slice's chip workers start and import JAX at once.
        with ThreadPoolExecutor(len(topologies),
                                thread_name_prefix="pathways-ray-reserve") as pool:
            futures = [pool.submit(Slice.reserve, spec, timeout_s=timeout_s,
                                   worker_timeout_s=worker_timeout_s, join_world=False,
                                   worker_cls=worker_cls) for spec in topologies]
        slices = [f.result() for f in futures if f.exception() is None]
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            raise failed
        # The world's order is the names' (the proxy's devices and the client's
        # groups follow it), whichever slice each shape's reservation got.
        slices.sort(key=lambda sl: slice_order(sl.name))
        form_world(slices, worker_timeout_s or TIMEOUTS["worker_start"].seconds(),
                        compilation_cache_dir)
    except BaseException:
        for sl in slices:
            sl.shutdown()
        if slices and slices[0].world_service is not None:
            slices[0].world_service.shutdown()
        raise
    for sl in slices:
        registry.register(sl)
    return slices
