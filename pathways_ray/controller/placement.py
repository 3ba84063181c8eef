"""Where arrays live (a ``Placement``: one slice, or slices of one JAX
world) and reserving separate slices side by side."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pathways_ray.chips.slice import Slice

__all__ = ["Placement", "reserve_all"]


@dataclass(frozen=True)
class Placement:
    """Where an array lives: one slice, or several slices of one JAX world (a
    multislice mesh). ``workers`` are in device order; ``start`` is where its devices
    are in the world (``commands.Where``): the first of them, or, for slices that are
    not side by side there (the survivors of a lost one), all of their ids."""

    name: str
    slices: tuple[Slice, ...]

    @property
    def workers(self) -> list:
        return [w for s in self.slices for w in s.workers]

    @property
    def start(self) -> int | tuple[int, ...]:
        # Read for every command a batch sends: O(slices) when they are side by side.
        if all(a.world_offset + a.num_chips == b.world_offset
               for a, b in itertools.pairwise(self.slices)):
            return self.slices[0].world_offset
        return tuple(d for s in self.slices
                     for d in range(s.world_offset, s.world_offset + s.num_chips))

    @property
    def chips(self) -> int:
        return sum(s.num_chips for s in self.slices)


def reserve_all(specs: list, opts: dict) -> list[Slice]:
    """Reserve separate slices side by side (their chip workers start and import JAX at
    the same time; one after another took 5 s a slice here). If any fails, the others
    are released and its error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    if len(specs) == 1:
        return [Slice.reserve(specs[0], **opts)]
    with ThreadPoolExecutor(len(specs), thread_name_prefix="pathways-ray-reserve") as pool:
        futures = [pool.submit(Slice.reserve, spec, **opts) for spec in specs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().shutdown()
        raise errors[0]
    return [f.result() for f in futures]
