"""Elastic training decisions, pure: what to do when a slice is lost, where each
micro-batch runs, when to grow back. No Ray, no JAX; tested in milliseconds.

The words follow pathwaysutils' elastic manager where the concept is the same
(``minimum_slice_count`` → ``min_slices``, ``active_slice_count`` → ``live``);
unlike it, nothing here re-runs the training loop or rewinds to storage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pathways_ray.errors import PathwaysError

__all__ = ["ElasticEvent", "NotEnoughSlices", "assign_microbatches", "check_failure",
           "recovery_source", "snapshot_due", "want_more"]

#: Steps between host-memory snapshots unless the run says otherwise.
DEFAULT_SNAPSHOT_EVERY = 10


class NotEnoughSlices(PathwaysError):
    """Fewer slices are left than the run's ``min_slices``."""


@dataclass(frozen=True)
class ElasticEvent:
    """Something the elastic trainer did; passed to ``on_elastic_event`` and logged.

    ``kind`` is ``"slice_lost"``, ``"step_retried"``, ``"save_retried"`` (a checkpoint
    written by another slice), ``"slice_joining"`` (a new slice is reserved and
    warming up), ``"slice_added"``, ``"waiting_for_slices"`` (below ``min_slices``,
    waiting for capacity) or ``"snapshot_restored"`` (no replica was left: the
    state came back from host memory and the steps since were run again).
    """

    kind: str
    step: int
    slice: str
    live: tuple[str, ...]
    reason: str = ""
    at: float = field(default_factory=time.time)


def check_failure(live: list[str], lost: list[str], min_slices: int, failures: int,
                  max_failures: int | None) -> None:
    """Raise ``NotEnoughSlices`` unless training may go on with ``live`` after losing
    ``lost`` (``failures`` losses so far, ``max_failures`` allowed; None: no limit)."""
    if len(live) < min_slices:
        raise NotEnoughSlices(
            f"lost slice(s) {lost}: {len(live)} left ({live}), below min_slices={min_slices}. "
            f"Lower min_slices, or add capacity and restart from a checkpoint")
    if max_failures is not None and failures > max_failures:
        raise NotEnoughSlices(
            f"lost slice(s) {lost}: that is {failures} slice losses, more than "
            f"max_failures={max_failures}; raise max_failures to keep going")


def assign_microbatches(num_microbatches: int, live: list[str]) -> list[str]:
    """The slice that computes each micro-batch: round robin over ``live`` in order, so
    N slices share N micro-batches one each, and N-1 slices share them unevenly (the
    first ones take two). Micro-batches keep their shape, so nothing recompiles."""
    if not live:
        raise ValueError("live=[] has no slice to run on")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be at least 1")
    return [live[m % len(live)] for m in range(num_microbatches)]


def want_more(live: int, target: int, joining: int) -> int:
    """How many more slices to reserve now: back up to ``target``, counting those
    already on their way."""
    return max(0, target - live - joining)


def snapshot_due(steps_done: int, every: int | None) -> bool:
    """Whether to snapshot after ``steps_done`` steps (every ``every`` steps; None or 0:
    never)."""
    if every is not None and every < 0:
        raise ValueError(f"snapshot_every={every} must be a step count (0 or None: off)")
    return bool(every) and steps_done > 0 and steps_done % every == 0


def recovery_source(survivors: list[str], snapshot_step: int | None, steps_done: int,
                    snapshot_every: int | None) -> tuple[str, int]:
    """Where the state of a slice that joins after a loss comes from: ``("replica",
    0)`` from a survivor, else ``("snapshot", steps to run again)``. Raises
    ``NotEnoughSlices`` when neither exists."""
    if survivors:
        return "replica", 0
    if snapshot_step is None:
        how = ("no snapshot had completed yet" if snapshot_every
               else "snapshots are off (snapshot_every=None)")
        raise NotEnoughSlices(f"every slice holding the parameters is lost and {how}; set "
                              f"snapshot_every, or restart from a checkpoint")
    return "snapshot", steps_done - snapshot_step
