"""What a TPU ``ScalingConfig`` asks for, checked before any worker starts.

Pure: no Ray import. ``plan_tpu`` turns the TPU fields of a Ray Train
``ScalingConfig`` (``topology``, ``accelerator_type``, ``num_workers``,
``resources_per_worker``) into a ``TpuPlan`` — how many slices, workers per
slice and chips per worker — or raises ``ValueError`` naming the field, the
value and what would fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pathways_ray.clusters.topology import Topology

__all__ = ["TpuPlan", "plan_tpu"]

_CHIPS_PER_WORKER = (1, 2, 4, 8)  # what one process may own on a TPU host


@dataclass(frozen=True)
class TpuPlan:
    """``num_slices`` slices of ``topology``; each worker holds ``chips_per_worker`` chips
    of one host."""

    topology: Topology
    num_slices: int
    chips_per_worker: int
    min_slices: int  # elastic configs: the fewest slices to run on

    @property
    def workers_per_slice(self) -> int:
        return self.topology.chips // self.chips_per_worker

    @property
    def workers_per_host(self) -> int:
        return self.topology.chips_per_host // self.chips_per_worker

    @property
    def num_workers(self) -> int:
        return self.workers_per_slice * self.num_slices

    def describe(self) -> str:
        per = "chip" if self.chips_per_worker == 1 else f"{self.chips_per_worker} chips"
        return (f"{self.num_slices} x {self.topology.describe()}, {self.num_workers} workers "
                f"(one per {per})")


def plan_tpu(
    *,
    topology: str | None,
    accelerator_type: str | None,
    num_workers: int | tuple[int, int],
    resources_per_worker: Mapping[str, float] | None,
    use_gpu: bool = False,
    chips_per_host: int | None = None,
) -> TpuPlan:
    """Check the TPU fields of a ``ScalingConfig(use_tpu=True, ...)`` and lay out slices."""
    if use_gpu:
        raise ValueError("ScalingConfig(use_tpu=True, use_gpu=True): a worker uses TPU chips "
                         "or GPUs, not both; drop use_gpu=True")
    if not accelerator_type:
        raise ValueError("ScalingConfig(accelerator_type=None) with use_tpu=True: name the TPU "
                         "generation, e.g. accelerator_type='TPU-V6E'")
    if not topology:
        raise ValueError(f"ScalingConfig(topology=None) with use_tpu=True: give the slice shape "
                         f"of {accelerator_type}, e.g. topology='2x4'")
    try:
        topo = Topology.parse(accelerator_type, topology, chips_per_host=chips_per_host)
    except ValueError as e:
        raise ValueError(f"ScalingConfig(topology={topology!r}, accelerator_type="
                         f"{accelerator_type!r}): {e}") from None

    per_host = topo.chips_per_host
    resources = dict(resources_per_worker or {})
    chips = resources.get("TPU", per_host)
    fits = [c for c in _CHIPS_PER_WORKER if c <= per_host and per_host % c == 0]
    if chips != int(chips) or int(chips) not in fits:
        raise ValueError(
            f"ScalingConfig(resources_per_worker={resources!r}): a TPU worker holds "
            f"{', '.join(map(str, fits[:-1]))}{' or ' if len(fits) > 1 else ''}{fits[-1]} "
            f"chips of one "
            f"{topo.generation.name} {topo.name} host ({per_host} chips per host); "
            f"use {{'TPU': 1}} for one worker per chip or {{'TPU': {per_host}}} for one per host")
    chips = int(chips)
    per_slice = topo.chips // chips
    if isinstance(num_workers, tuple):
        low, high = num_workers
    else:
        low = high = num_workers
    for field, n in (("num_workers", high), ("min_workers", low)):
        if not isinstance(n, int) or n < per_slice or n % per_slice:
            some = ", ".join(str(per_slice * k) for k in (1, 2, 3))
            raise ValueError(
                f"ScalingConfig({field}={n!r}) does not fit topology={topology!r}: one "
                f"{topo.describe()} slice takes {per_slice} workers of {{'TPU': {chips}}}; "
                f"use a multiple of {per_slice} ({some}, ... for 1, 2, 3 slices)")
    return TpuPlan(topology=topo, num_slices=high // per_slice, chips_per_worker=chips,
                   min_slices=low // per_slice)
