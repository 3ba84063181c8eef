"""Who forwards a slice's command stream to whom. Pure (no Ray).

The controller used to send every batch to every chip worker: one message per
chip per batch, so its CPU per step grew with the fleet (measured by
``benchmarks/dispatch_scale.py``). Pathways runs one executor per host; here the
chip workers relay. The controller sends each batch to one chip of the slice
(the root); every host's first chip forwards it to the other chips of its host
and to the first chips of up to ``fanout`` other hosts, which do the same: a
tree over the hosts, ``fanout`` wide, with each host's chips below its first.

Each node acknowledges a batch once it and its whole subtree have run it, so
the root's acknowledgements mean to the controller what every chip's did:
"the slice ran everything up to batch N". ``fanout=0`` keeps the old direct
path (one stream per chip) for comparison.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["FANOUT_ENV", "check_fanout", "default_fanout", "relay_tree"]

FANOUT_ENV = "PATHWAYS_RAY_FANOUT"
DEFAULT_FANOUT = 8  # hosts a host forwards to: 64 hosts (256 chips) are 2 hops deep


def default_fanout() -> int:
    """``$PATHWAYS_RAY_FANOUT`` (hosts each host relays to; 0: the controller sends to
    every chip itself), default 8."""
    raw = os.environ.get(FANOUT_ENV)
    if raw is None:
        return DEFAULT_FANOUT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{FANOUT_ENV}={raw!r} must be a whole number of hosts (0 turns "
                         f"relaying off)") from None
    if value < 0:
        raise ValueError(f"{FANOUT_ENV}={raw!r} must be 0 (no relaying) or more")
    return value


def check_fanout(fanout) -> int:
    """``fanout`` as given to ``connect(fanout=)``, or a ``ValueError`` saying what fits."""
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 0:
        raise ValueError(f"fanout={fanout!r} must be a whole number of hosts each host relays "
                         f"to (8 by default), or 0 for one stream per chip")
    return fanout


def relay_tree(hosts: Sequence[Sequence[int]], fanout: int) -> dict[int, list[int]]:
    """Children of every relaying rank, for the chips ``hosts`` (one list of ranks per
    host, the host order of the slice). The root is ``hosts[0][0]``; the ranks in
    the result's keys and values cover every chip once, root excluded from values.

    A host's first chip forwards to the rest of its host first (they are one local hop
    away), then to the first chips of its child hosts: host ``i``'s children are hosts
    ``fanout*i + 1 .. fanout*i + fanout`` (a heap), so the depth grows with the log of
    the number of hosts.
    """
    if fanout < 1:
        raise ValueError(f"fanout={fanout!r} must be 1 or more (0 means no relay tree: "
                         f"do not build one)")
    if not hosts or any(not h for h in hosts):
        raise ValueError(f"hosts={[list(h) for h in hosts]!r} must be non-empty lists of "
                         f"chip ranks")
    seen = [r for h in hosts for r in h]
    if len(set(seen)) != len(seen):
        raise ValueError(f"hosts={[list(h) for h in hosts]!r} name a rank twice")
    tree: dict[int, list[int]] = {}
    for i, chips in enumerate(hosts):
        below = [hosts[j][0] for j in range(fanout * i + 1, min(fanout * i + fanout + 1,
                                                                 len(hosts)))]
        children = list(chips[1:]) + below
        if children:
            tree[chips[0]] = children
    return tree
