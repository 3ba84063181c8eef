"""The arithmetic of one data parallel step, as plain JAX functions: gradients of a group
of micro-batches (accumulated in float32, computed in a chosen dtype), their sum, and
the optimizer's update of parameters and state. No Ray: ``DataParallelTrainer``
compiles these for the slices, and the fast tests run them on local CPU devices.

The optimizer is an ``optax.GradientTransformation`` (``init``, ``update``); ``SGD`` is
the one ``lr=`` stands for, without importing optax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["SGD", "StepFns", "adamw_warmup_cosine", "init_state", "opt_shardings",
           "optimizer_of", "single_process", "step_count", "step_fns"]


class SGD(NamedTuple):
    """Plain gradient descent, ``p - lr * g``, as a GradientTransformation with no state."""

    lr: float

    def init(self, params):
        return ()

    def update(self, grads, state, params=None):
        import jax

        return jax.tree.map(lambda g: -self.lr * g, grads), state


def optimizer_of(optimizer, lr: float | None):
    """The optimizer a trainer runs: ``optimizer`` (an optax GradientTransformation), or
    ``SGD(lr)``; exactly one of them."""
    if (optimizer is None) == (lr is None):
        raise ValueError(f"give optimizer= (an optax.GradientTransformation, e.g. "
                         f"optax.adamw(3e-4)) or lr= (plain SGD), not "
                         f"{'both' if optimizer is not None else 'neither'}")
    if optimizer is None:
        if not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"lr={lr!r} must be a positive number")
        return SGD(float(lr))
    if not (callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))):
        raise TypeError(f"optimizer={optimizer!r} is not an optax.GradientTransformation "
                        f"(it needs init(params) and update(grads, state, params))")
    return optimizer


def adamw_warmup_cosine(peak_lr: float, total_steps: int, *, warmup_steps: int | None = None,
                        weight_decay: float = 0.01, clip_norm: float | None = 1.0,
                        end_lr_ratio: float = 0.1):
    """What transformers are trained with: AdamW whose learning rate warms up linearly to
    ``peak_lr`` over ``warmup_steps`` (default a tenth of the run) and decays along a cosine
    to ``end_lr_ratio * peak_lr`` at ``total_steps``, after clipping the gradients'
    global norm to ``clip_norm`` (None: no clipping)."""
    import optax

    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be at least 1")
    warmup = total_steps // 10 if warmup_steps is None else warmup_steps
    if not 0 <= warmup < total_steps:
        raise ValueError(f"warmup_steps={warmup} must be in 0..{total_steps - 1} "
                         f"(total_steps={total_steps})")
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, total_steps,
                                                  end_value=end_lr_ratio * peak_lr)
    adamw = optax.adamw(schedule, weight_decay=weight_decay)
    return adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm),
                                                       adamw)


def init_state(optimizer, params) -> dict:
    """What a step carries from one to the next: ``{"params": params, "opt": its state}``,
    without ``"opt"`` for an optimizer that keeps no arrays (``SGD``, plain
    ``optax.sgd``). The state on the host, as numpy arrays."""
    import jax
    import numpy as np

    opt = optimizer.init(params)
    if not jax.tree.leaves(opt):
        return {"params": params}
    return {"params": params, "opt": jax.tree.map(np.asarray, opt)}


def opt_shardings(opt_state, params, param_shardings, replicated):
    """A sharding for every array of ``opt_state``: the parameters' own for each part that
    mirrors them (Adam's moments: same structure, same shapes), ``replicated`` for the
    rest (step counts, scalars)."""
    import jax

    structure = jax.tree.structure(params)
    shapes = [getattr(p, "shape", ()) for p in jax.tree.leaves(params)]

    def mirrors(x) -> bool:
        return (jax.tree.structure(x) == structure
                and [getattr(v, "shape", ()) for v in jax.tree.leaves(x)] == shapes)

    return jax.tree.map(lambda x: param_shardings if mirrors(x) else replicated, opt_state,
                        is_leaf=mirrors)


def step_count(opt_state, read: Callable | None = None) -> int | None:
    """The optimizer's own step count (optax's ``count`` fields, which its schedules
    read), each read by ``read`` (default ``np.asarray``; ``RemoteArray.fetch`` for the
    state on a slice); None if it keeps none. Raises if its counts disagree."""
    import jax
    import numpy as np

    read = read or np.asarray
    counts = {int(read(v)) for path, v in jax.tree_util.tree_flatten_with_path(opt_state)[0]
              if path and getattr(path[-1], "name", None) == "count"}
    if len(counts) > 1:
        raise RuntimeError(f"the optimizer's step counts disagree: {sorted(counts)}")
    return counts.pop() if counts else None


@dataclass(frozen=True)
class StepFns:
    """``grads(params, group) -> vector`` (the group's summed gradients, raveled, with
    its summed loss last), ``add(a, b)`` and ``apply(state, total) -> (state, mean
    loss)`` (``total``: every group's vector summed in group order): the single
    controller's three programs. ``step(state, group) -> (state, mean loss)`` is the
    same arithmetic for one SPMD program that holds the whole global batch as one
    group (a multi-controller loop): no raveling, so sharded gradients stay sharded."""

    grads: Callable
    add: Callable
    apply: Callable
    step: Callable


def step_fns(loss_fn: Callable, params, optimizer, *, microbatches: int, total: int,
             compute_dtype: Any = None) -> StepFns:
    """The step's functions for ``loss_fn(params, batch) -> scalar``.

    A group holds ``microbatches`` micro-batches stacked on a new leading axis (or is
    one micro-batch when ``microbatches == 1``); its gradients are summed in float32,
    one micro-batch after another (``lax.scan``: one micro-batch's activations at a
    time). ``total`` is the number of micro-batches in the global batch: the update
    uses their mean. ``compute_dtype`` (e.g. ``jnp.bfloat16``): the loss sees the
    floating parameters cast to it, while the parameters, gradients and optimizer
    state stay in their own dtype (float32 master weights). The state is
    ``init_state``'s: the optimizer's is in it where it keeps arrays."""
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a whole number >= 1 "
                         f"(micro-batches per group and step)")
    if compute_dtype is not None:
        try:
            floating = jnp.issubdtype(jnp.dtype(compute_dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"compute_dtype={compute_dtype!r} is not a floating dtype; use "
                             f"e.g. jnp.bfloat16 (or None to compute in the parameters' own)")
    _, unravel = ravel_pytree(params)

    def cast(p):
        if compute_dtype is None:
            return p
        return jax.tree.map(lambda x: x.astype(compute_dtype)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, p)

    def one(p, batch):
        loss, g = jax.value_and_grad(lambda q: loss_fn(cast(q), batch).astype(jnp.float32))(p)
        return loss, jax.tree.map(lambda x: x.astype(jnp.float32), g)

    def summed(p, group):
        """The group's (loss, gradients), each summed over its micro-batches."""
        if microbatches == 1:
            return one(p, group)

        def body(acc, batch):
            return jax.tree.map(jnp.add, acc, one(p, batch)), None

        acc, _ = jax.lax.scan(body, one(p, group[0]), group[1:])
        return acc

    def update(state, g, loss):
        p = state["params"]
        g = jax.tree.map(lambda x, ref: x.astype(ref.dtype), g, p)
        kept = "opt" in state  # (a stateless optimizer's empty state is made here)
        updates, opt = optimizer.update(g, state["opt"] if kept else optimizer.init(p), p)
        new = jax.tree.map(lambda x, u: (x + u).astype(x.dtype), p, updates)
        return ({"params": new, "opt": opt} if kept else {"params": new}), loss

    def grads(p, group):
        loss, g = summed(p, group)
        return jnp.concatenate([ravel_pytree(g)[0], loss[None]])

    def add(a, b):
        return a + b

    def apply(state, vec):
        return update(state, unravel(vec[:-1] / total), vec[-1] / total)

    def step(state, group):
        loss, g = summed(state["params"], group)
        return update(state, jax.tree.map(lambda x: x / total, g), loss / total)

    grads.__name__, add.__name__, apply.__name__ = "dp_grads", "dp_add", "dp_apply"
    return StepFns(grads, add, apply, step)


def single_process(loss_fn: Callable, params, optimizer, batches) -> tuple[list[float], Any,
                                                                          Any]:
    """The run a data parallel one must match: ``optimizer`` on each whole global batch
    in this process (its default device); returns the losses, the final parameters and
    the optimizer's state."""
    import jax

    params = jax.tree.map(jax.numpy.asarray, params)
    state = optimizer.init(params)

    @jax.jit
    def step(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        updates, s = optimizer.update(g, s, p)
        return jax.tree.map(lambda a, u: (a + u).astype(a.dtype), p, updates), s, loss

    losses = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return losses, params, state
