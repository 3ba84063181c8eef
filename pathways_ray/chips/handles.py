"""Handles to a slice's actors (a ``SliceWorker`` per chip, a ``SidecarInfo`` per host)
and waiting on them: a dead one is named by rank and host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pathways_ray import boundary
from pathways_ray.chips.worker_env import ChipInfo
from pathways_ray.errors import WorkerDied

__all__ = ["SidecarInfo", "SliceWorker", "ping_all"]


@dataclass(frozen=True)
class SliceWorker:
    """A chip worker and where it runs, in rank order."""

    rank: int
    info: ChipInfo
    actor_name: str
    handle: object  # ray.actor.ActorHandle
    bundle: int = 0  # its bundle in the slice's placement group


@dataclass(frozen=True)
class SidecarInfo:
    """The sidecar process of one host of a slice (``sidecar_host.SidecarHost``)."""

    worker_id: int
    ranks: tuple[int, ...]  # the slice's chips on this host
    handle: object


def _get(refs, timeout_s: float, what: str, workers=None):
    """Wait for chip workers within ``timeout_s`` (the caller's argument of that name);
    a dead one becomes ``WorkerDied`` naming the ranks and hosts found dead."""

    def died(e: BaseException) -> WorkerDied:
        where = ""
        if workers:
            dead = [w for w, h in ping_all(workers, 2.0) if h != "ok"]
            where = " (" + ", ".join(f"rank {w.rank} on TPU worker {w.info.worker_id} chip "
                                     f"{w.info.chip}" for w in dead) + ")"
        return WorkerDied(f"a chip worker died while {what}{where}: {e}")

    return boundary.get(refs, timeout=timeout_s, what=what, died=died)


def ping_all(workers: Sequence[SliceWorker], timeout_s: float) -> list[tuple[SliceWorker, str]]:
    """Each worker with ``"ok"``, ``"dead"`` or ``"unresponsive"``."""
    return boundary.health([(w, w.handle) for w in workers], timeout_s)
