"""The coordination service of a JAX world of several slices, kept off the chips.

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

__all__ = ["WorldService"]

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
