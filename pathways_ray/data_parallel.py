"""Data parallel across slices, data x model parallel within each, through the controller.

Each step, every slice computes the loss and gradients of its share of the
global batch (one program, SPMD over the slice's chips); gradients are raveled
into one vector inside that program, so exchanging them is one array per
slice pair, moved worker to worker through Ray's object store (DCN in Pathways
terms); each slice then averages and applies the update (a second program).
Slices hold identical parameter replicas throughout.

Each slice here is a JAX world of its own (plain ``connect()``), so losing one
slice leaves the others whole. ``connect(multislice=True)`` is the other model:
one world over every slice's chips, one SPMD program across them, one failure
domain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pathways_ray.client import Client, RemoteArray

__all__ = ["DataParallelTrainer"]


@dataclass
class StepResult:
    losses: list[RemoteArray]  # one scalar per slice, still on the slices

    def mean_loss(self) -> float:
        return float(np.mean([float(x.fetch()) for x in self.losses]))


class DataParallelTrainer:
    def __init__(self, client: Client, loss_fn: Callable, params: dict, param_specs: dict,
                 *, mesh_shape: tuple[int, int], lr: float, slices: list[str] | None = None):
        import jax
        from jax.flatten_util import ravel_pytree
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.client = client
        self.slices = slices or [s.name for s in client.slices]
        self.mesh = client.mesh(mesh_shape, ("data", "model"))
        self.param_shardings = jax.tree.map(lambda p: NamedSharding(self.mesh, p), param_specs,
                                            is_leaf=lambda x: isinstance(x, P))
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.replicated = NamedSharding(self.mesh, P())
        _, unravel = ravel_pytree(params)

        def grads(p, batch):
            loss, g = jax.value_and_grad(loss_fn)(p, batch)
            return loss, ravel_pytree(g)[0]

        def apply(p, *flat_grads):
            mean = sum(flat_grads) / len(flat_grads)
            return jax.tree.map(lambda a, b: a - lr * b, p, unravel(mean))

        grads.__name__, apply.__name__ = "lm_grads", "lm_apply"
        self._grads = client.jit(grads, out_shardings=(self.replicated, self.replicated))
        self._apply = client.jit(apply, out_shardings=self.param_shardings)
        self.params = {s: client.device_put(params, self.param_shardings, slice=s)
                       for s in self.slices}

    def step(self, batch: np.ndarray) -> StepResult:
        """One step on the global ``batch`` (split evenly over the slices)."""
        n = len(self.slices)
        if len(batch) % n:
            raise ValueError(f"batch of {len(batch)} rows does not split over {n} slices")
        parts = np.split(batch, n)
        out = {s: self._grads(self.params[s],
                              self.client.device_put(part, self.batch_sharding, slice=s))
               for s, part in zip(self.slices, parts, strict=True)}
        for s in self.slices:
            # Every slice sums the gradients in the same (slice) order, so the replicas
            # stay bit-identical (float addition is not associative).
            flat = [out[o][1] if o == s else self.client.reshard(out[o][1], self.replicated,
                                                                  slice=s)
                    for o in self.slices]
            self.params[s] = self._apply(self.params[s], *flat)
        return StepResult([out[s][0] for s in self.slices])

    def fetch_params(self, slice_name: str | None = None) -> dict:
        import jax

        return jax.tree.map(lambda a: a.fetch(), self.params[slice_name or self.slices[0]])
