"""The data parallel step's arithmetic (``pathways_ray.elastic.optim``) on local CPU, no Ray:
groups of accumulated micro-batches summed in group order and an optax update give
a single-process optax run's losses; bf16 compute keeps float32 master weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pathways_ray.demo.lm import LMConfig, MarkovText, init_params, loss_fn
from pathways_ray.elastic.optim import (
    SGD,
    adamw_warmup_cosine,
    init_state,
    opt_shardings,
    optimizer_of,
    single_process,
    step_count,
    step_fns,
)

CFG = LMConfig(vocab=32, seq=8, d_model=16, heads=2, layers=1, d_ff=32)
GROUPS, K, ROWS, STEPS = 3, 2, 24, 8


def _batches(n):
    rng, text = np.random.default_rng(0), MarkovText(CFG.vocab)
    return [text.batch(rng, ROWS, CFG.seq + 1) for _ in range(n)]


def _run_as_the_trainer(optimizer, batches, *, microbatches=K, compute_dtype=None):
    """The trainer's arithmetic in one process: each group's vector, summed in group
    order, then apply: the losses and the final state."""
    params = init_params(CFG)
    fns = step_fns(lambda p, b: loss_fn(p, b, CFG), params, optimizer,
                   microbatches=microbatches, total=GROUPS * microbatches,
                   compute_dtype=compute_dtype)
    grads, add, apply = jax.jit(fns.grads), jax.jit(fns.add), jax.jit(fns.apply)
    state = init_state(optimizer, params)
    losses = []
    for batch in batches:
        groups = np.split(batch, GROUPS)
        if microbatches > 1:
            groups = [g.reshape(microbatches, -1, *g.shape[1:]) for g in groups]
        vecs = [grads(state["params"], g) for g in groups]
        total = vecs[0]
        for v in vecs[1:]:
            total = add(total, v)
        state, loss = apply(state, total)
        losses.append(float(loss))
    return losses, state


def _single_process(optimizer, batches):
    return single_process(lambda p, b: loss_fn(p, b, CFG), init_params(CFG), optimizer,
                          batches)


def test_accumulated_groups_with_adamw_give_single_process_optax_losses():
    opt = adamw_warmup_cosine(1e-2, STEPS, warmup_steps=2, clip_norm=0.5)
    batches = _batches(STEPS)
    got, state = _run_as_the_trainer(opt, batches)
    want, params, ref_opt = _single_process(opt, batches)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert step_count(state["opt"]) == step_count(ref_opt) == STEPS
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["params"]))


def test_the_lr_shorthand_is_plain_sgd_with_no_state():
    batches = _batches(3)
    got, state = _run_as_the_trainer(SGD(0.2), batches, microbatches=1)
    want, _, _ = _single_process(optax.sgd(0.2), batches)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert set(state) == {"params"} and step_count(()) is None


def test_bf16_compute_keeps_float32_master_weights_and_state():
    opt = adamw_warmup_cosine(1e-2, STEPS, warmup_steps=2)
    batches = _batches(STEPS)
    got, state = _run_as_the_trainer(opt, batches, compute_dtype=jnp.bfloat16)
    want, _ = _run_as_the_trainer(opt, batches)
    assert {x.dtype for x in jax.tree.leaves(state)} <= {jnp.dtype(jnp.float32),
                                                          jnp.dtype(jnp.int32)}
    np.testing.assert_allclose(got, want, rtol=2e-2)  # bf16 arithmetic, same trajectory
    assert got[-1] < got[0]


def test_optimizer_state_is_sharded_like_the_parameters_it_mirrors():
    params = {"w": np.zeros((4, 2), np.float32), "b": np.zeros(2, np.float32)}
    shardings = {"w": "W", "b": "B"}
    state = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)).init(params)
    got = opt_shardings(state, params, shardings, "R")
    adam = got[1][0]
    assert adam.mu == shardings and adam.nu == shardings and adam.count == "R"
    # A lone array is not taken for the parameters just because it is one leaf too.
    lone = opt_shardings(optax.adam(1e-3).init(np.zeros(3)), np.zeros(3), "P", "R")
    assert lone[0].mu == "P" and lone[0].count == "R"


def test_bad_optimizer_settings_are_named():
    with pytest.raises(ValueError, match="optimizer= .* or lr= .* not both"):
        optimizer_of(optax.sgd(0.1), 0.1)
    with pytest.raises(ValueError, match="not neither"):
        optimizer_of(None, None)
    with pytest.raises(ValueError, match="lr=-1 must be a positive number"):
        optimizer_of(None, -1)
    with pytest.raises(TypeError, match="not an optax.GradientTransformation"):
        optimizer_of(object(), None)
    with pytest.raises(ValueError, match="microbatches=0 must be a whole number >= 1"):
        step_fns(loss_fn, {"w": np.zeros(2, np.float32)}, SGD(0.1), microbatches=0, total=1)
    with pytest.raises(ValueError, match="compute_dtype='bf16' is not a floating dtype"):
        step_fns(loss_fn, {"w": np.zeros(2, np.float32)}, SGD(0.1), microbatches=1, total=1,
                 compute_dtype="bf16")
    with pytest.raises(ValueError, match="warmup_steps=10 must be in 0..9"):
        adamw_warmup_cosine(1e-3, 10, warmup_steps=10)
    schedule_at = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10, end_value=1e-4)
    assert float(schedule_at(0)) == 0.0 and float(schedule_at(2)) == pytest.approx(1e-3)
    bad = (optax.ScaleByAdamState(np.int32(3), (), ()), optax.ScaleByScheduleState(np.int32(4)))
    with pytest.raises(RuntimeError, match=r"disagree: \[3, 4\]"):
        step_count(bad)


def test_one_spmd_step_is_the_same_arithmetic_without_raveling():
    """``step`` (a multi-controller loop's one program) gives the three programs'
    losses and state when the whole global batch is one group."""
    opt = adamw_warmup_cosine(1e-2, STEPS, warmup_steps=2)
    params = init_params(CFG)
    fns = step_fns(lambda p, b: loss_fn(p, b, CFG), params, opt, microbatches=K, total=K)
    step = jax.jit(fns.step)
    state = init_state(opt, params)
    losses = []
    for batch in _batches(4):
        state, loss = step(state, batch.reshape(K, -1, *batch.shape[1:]))
        losses.append(float(loss))
    want, _, _ = _single_process(opt, _batches(4))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
