"""Which IFRT proxy protocol versions this server speaks, and the one a session uses.
Pure (no gRPC, no Ray).

jaxlib 0.10.2's client asks for protocol versions 16..25 with IFRT serdes version 3
(measured, see DESIGN.md); the server answers with one version in both ranges, or
an error that names both ranges.
"""

from __future__ import annotations

__all__ = ["MAX_VERSION", "MIN_VERSION", "SERDES_VERSION", "VersionMismatch", "negotiate"]

# The range of jaxlib's own client; the messages come from that jaxlib's descriptors.
MIN_VERSION = 16
MAX_VERSION = 25
SERDES_VERSION = 3


class VersionMismatch(ValueError):
    """The client's protocol versions and this server's do not overlap."""


def negotiate(client_min: int, client_max: int) -> int:
    """The newest protocol version both sides speak; ``VersionMismatch`` naming both
    ranges (and what to do) when there is none."""
    if client_min > client_max:
        raise VersionMismatch(f"the client's protocol versions {client_min}..{client_max} "
                              f"are an empty range")
    low, high = max(client_min, MIN_VERSION), min(client_max, MAX_VERSION)
    if low > high:
        raise VersionMismatch(
            f"the client speaks IFRT proxy protocol versions {client_min}..{client_max}, "
            f"this pathways-ray proxy {MIN_VERSION}..{MAX_VERSION}: use the jaxlib that "
            f"pathways-ray pins (0.10.2) on the client")
    return high
