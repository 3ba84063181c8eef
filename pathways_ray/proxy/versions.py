"""Which IFRT proxy protocol versions this server speaks, and the one a session uses.
Pure (no gRPC, no Ray).

Measured with a listener that logs ``GetVersion``: jaxlib 0.10.2's client asks for
protocol versions 16..25, jaxlib 0.12.1's for 16..28, both with IFRT serdes version 3.
The messages come from the newest supported jaxlib's descriptors (a superset of the
older ones': protobuf keeps old fields' numbers). The server answers with the
newest version in both ranges, or an error that names both ranges.
"""

from __future__ import annotations

__all__ = ["MAX_VERSION", "MIN_VERSION", "SERDES_VERSION", "VersionMismatch", "negotiate"]

# jaxlib 0.10.2's client (16..25) through jaxlib 0.12.1's (16..28).
MIN_VERSION = 16
MAX_VERSION = 28
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
            f"this pathways-ray proxy {MIN_VERSION}..{MAX_VERSION}: use a jaxlib from 0.10.2 "
            f"to 0.12.1 on the client")
    return high
