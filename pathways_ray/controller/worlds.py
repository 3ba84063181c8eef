"""Forming the JAX world of one or several slices (``form_world``), and the
coordination service of a world of several slices, kept off the chips.

``jax.distributed.initialize`` starts a world's coordination service in process 0,
on a chip: when that chip's host dies every other process of the world aborts
within ~0.3 s (measured), so one lost slice takes the others with it. A world of
several slices is elastic only if its service outlives any slice. ``WorldService``
runs it in the process that owns the world (the controller, off every TPU host),
*recoverable* (JAX's ``jax_enable_recoverability``: a task that fails does not fail
the others), and the chips join it as clients only (``JaxWorld.init_world(...,
service_outside=True)``).

Measured with JAX 0.12.1 on the emulated fleet (gloo): after a slice's processes are
killed the survivors stay up, and a program over the survivors' devices alone runs
at once (its collectives are a new gloo clique of those devices). A process that
comes back under a dead one's id cannot take part again: the survivors keep the
clique they had with its predecessor, and its rendezvous keys are taken; a world
that takes a slice back is a new world (``Controller``'s regrowth).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

from pathways_ray.chips.handles import _get
from pathways_ray.clusters import registry
from pathways_ray.clusters.cluster import slice_order
from pathways_ray.config import TIMEOUTS

__all__ = ["WorldService", "form_world", "reserve_joint"]

logger = logging.getLogger(__name__)


class WorldService:
    """A recoverable JAX coordination service for ``num_processes`` chips, on this host."""

    def __init__(self, num_processes: int, *, heartbeat_timeout_s: int = 100,
                 shutdown_timeout_s: int = 5):
        import ray
        from jax._src.lib import _jax

        self.num_processes = num_processes
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        self._service = _jax.get_distributed_runtime_service(
            f"[::]:{port}", num_processes, heartbeat_timeout=heartbeat_timeout_s,
            shutdown_timeout=shutdown_timeout_s, recoverable=True)
        self.address = f"{ray.util.get_node_ip_address()}:{port}"
        logger.info("JAX world service for %d chips at %s", num_processes, self.address)

    def shutdown(self) -> None:
        if self._service is not None:
            try:
                self._service.shutdown()
            finally:
                self._service = None


def form_world(slices: list, timeout_s: float, compilation_cache_dir: str | None) -> None:
    """One JAX world over the chips of ``slices``, slice after slice in rank order."""
    workers = [w for sl in slices for w in sl.workers]
    ports = _get([w.handle.reserve_port.remote() for w in workers], timeout_s,
                 "reserving ports")
    addresses = [f"{w.info.ip}:{p}" for w, p in zip(workers, ports, strict=True)]
    coordinator = addresses[0]
    outside = len(slices) > 1 and all(w.info.platform == "cpu" for w in workers)
    if outside:
        service = WorldService(len(workers))
        coordinator = service.address
        for sl in slices:
            sl.world_service = service
    refs, offset = [], 0
    for sid, sl in enumerate(slices):
        n = sl.num_chips
        multislice = ((sid, len(slices), workers[0].info.ip) if len(slices) > 1 else None)
        for w in sl.workers:
            refs.append(w.handle.init_world.remote(
                coordinator=coordinator,
                num_processes=len(workers),
                rank=offset + w.rank,
                timeout_s=timeout_s,
                process_addresses=addresses[offset:offset + n],
                slice_shape=sl.topology.shape,
                compilation_cache_dir=compilation_cache_dir,
                slice_devices=(offset, n),
                multislice=multislice,
                service_outside=outside,
            ))
        sl.world_offset = offset
        offset += n
    world = _get(refs, timeout_s + 30, "initializing the JAX world")
    for info in world:
        if info["device_count"] != len(workers):
            raise RuntimeError(
                f"rank {info['rank']} sees {info['device_count']} devices, the world has "
                f"{len(workers)} chips"
            )
    for sl in slices:
        sl.world = world[sl.world_offset:sl.world_offset + sl.num_chips]


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
