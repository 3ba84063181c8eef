"""A Ray cluster's TPU hosts: ``Fleet.attach()`` joins a running cluster (KubeRay on
GKE, a TPU VM) and emulates nothing. The emulator, ``LocalFleet``, lives in
``local_fleet.py``; nothing in the runtime imports it.
"""

from __future__ import annotations

import signal
import threading

from pathways_ray.clusters.cluster import SliceView, cluster_slices
from pathways_ray.config import NAMESPACE
from pathways_ray.errors import FleetError

__all__ = ["Fleet"]


def _ensure_connected(address: str, namespace: str = NAMESPACE,
                      log_to_driver: bool = True) -> None:
    import ray

    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if current == address or address == "auto":
            return
        raise FleetError(
            f"this process is already connected to the Ray cluster at {current}, not "
            f"{address}; call ray.shutdown() first"
        )
    # ray.init replaces the process's SIGTERM handler with sys.exit; a program that
    # installed its own (the CLI's: unwind as on Ctrl-C) keeps it.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(address=address, namespace=namespace, logging_level="WARNING",
             log_to_driver=log_to_driver)
    if callable(previous):
        signal.signal(signal.SIGTERM, previous)


class Fleet:
    """A Ray cluster's TPU hosts, grouped into slices. Emulates nothing."""

    def __init__(self, address: str):
        self.address = address

    @classmethod
    def attach(cls, address: str = "auto", *, log_to_driver: bool = True) -> Fleet:
        """Connect this process to a running Ray cluster (``ray.init(address=...)``).

        Authentication comes from the environment as for any Ray driver
        (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN_PATH`` or ``RAY_AUTH_TOKEN``).
        """
        import ray

        _ensure_connected(address, log_to_driver=log_to_driver)
        return cls(ray.get_runtime_context().gcs_address)

    def slices(self) -> list[SliceView]:
        """The TPU slices the cluster has right now, with free chips per host."""
        return cluster_slices()

    def shutdown(self) -> None:
        """Disconnect; an attached cluster keeps running."""
        import ray

        if ray.is_initialized():
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
