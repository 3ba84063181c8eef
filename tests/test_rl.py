"""The RL loop across two slices (MPMD): a learner trains, a sampler generates.

One fleet of 2 x v6e 2x2 for the module: the learner's layout is data x model
(2x2), the sampler's model parallel only (1x4), so every weight sync reshards
as it moves, worker to worker.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import psutil
import pytest
import ray

from pathways_ray import LocalFleet, SliceLost, connect
from pathways_ray.demo.rl import RLConfig, RLLoop, chain_logprobs, greedy_reward

pytestmark = pytest.mark.slow

ITERATIONS = 30


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="trl",
                    log_to_driver=False) as f:
        yield f


def _controller_rss(client) -> int:
    pid = ray.get(client._controller.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
    return psutil.Process(pid).memory_info().rss


def _weights(tree) -> list[np.ndarray]:
    return [a.fetch(timeout_s=120) for a in jax.tree.leaves(tree)]


def test_reward_rises_and_weights_move_worker_to_worker(fleet):
    """30 iterations: the mean reward rises; after a sync the sampler's weights are
    bit-identical to the learner's (in another layout); the client sends no bytes and
    fetches only the rewards; the controller's and the client's memory stay flat while
    ~13 MB of weights move."""
    client = connect()
    try:
        loop = RLLoop(client, RLConfig(lr=0.05), learner=0, sampler=1)
        assert loop.sampler_shardings["l0"]["w1"].mesh.axis_sizes == (1, 4)
        assert loop.learner_shardings["l0"]["w1"].mesh.axis_sizes == (2, 2)
        rewards, rss = [], {}
        for i in range(ITERATIONS):
            if i == 5:
                sent = dict(client.counters)
                rss = {"client": psutil.Process(os.getpid()).memory_info().rss,
                       "controller": _controller_rss(client)}
            rewards.append(float(loop.step().fetch(timeout_s=120)))
        moved = (ITERATIONS - 5) * loop.weight_bytes
        assert client.counters["put_bytes"] == sent["put_bytes"]
        assert client.counters["fetched_bytes"] - sent["fetched_bytes"] == 4 * (ITERATIONS - 5)
        grew = {"client": psutil.Process(os.getpid()).memory_info().rss - rss["client"],
                "controller": _controller_rss(client) - rss["controller"]}
        assert max(grew.values()) < moved / 3, (grew, moved)
        # the same weights in two layouts on two slices, bit for bit
        learner, sampler = _weights(loop.params), _weights(loop.sampler_params)
        assert all(np.array_equal(a, b) for a, b in zip(learner, sampler, strict=True))
        first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
        assert first < -7.0, rewards  # a fresh policy writes nearly at random
        assert last > first + 0.5, rewards
        assert last < greedy_reward(loop.cfg) + 1.0
    finally:
        client.close()


def test_rollouts_are_scored_by_the_chain(fleet):
    """A rollout's rewards are the chain's log-probabilities of its moves."""
    client = connect()
    try:
        cfg = RLConfig(rows=8)
        loop = RLLoop(client, cfg, learner=0, sampler=1)
        tokens, rewards = (a.fetch(timeout_s=120) for a in loop._rollout)
        assert tokens.shape == (8, cfg.model.seq + 1) and rewards.shape == (8, cfg.model.seq)
        assert tokens.min() >= 0 and tokens.max() < cfg.model.vocab
        np.testing.assert_array_equal(rewards, chain_logprobs(cfg)[tokens[:, :-1], tokens[:, 1:]])
    finally:
        client.close()


def test_reshard_of_a_pytree_checks_its_arguments(fleet, monkeypatch):
    """One sharding per array or one for all; a host array is not a RemoteArray; an
    unknown $PATHWAYS_RAY_TRANSFER is named before anything moves."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    client = connect()
    try:
        sh = NamedSharding(client.mesh((4,), ("chips",)), P("chips"))
        xs = client.device_put({"a": np.arange(8.0), "b": np.ones(4)}, sh, slice=0)
        assert xs["a"].dtype == jax.numpy.zeros(1, np.float64).dtype  # as jax.device_put
        with pytest.raises(ValueError, match="sharding has 3 leaves for 2 arrays"):
            client.reshard(xs, [sh, sh, sh], slice=1)
        with pytest.raises(TypeError, match="use device_put"):
            client.reshard(np.ones(4), sh, slice=1)
        with monkeypatch.context() as env:
            env.setenv("PATHWAYS_RAY_TRANSFER", "fast")
            with pytest.raises(ValueError, match="PATHWAYS_RAY_TRANSFER='fast'.*pull, objects"):
                client.reshard(xs, sh, slice=1)
        moved = client.reshard(xs, sh, slice=1)
        assert {k: v.slice for k, v in moved.items()} == {"a": client.slice(1).name,
                                                          "b": client.slice(1).name}
        np.testing.assert_array_equal(moved["a"].fetch(timeout_s=120), np.arange(8.0))
    finally:
        client.close()


def test_losing_the_sampler_slice_raises_slice_lost(fleet):
    """The sampler's host is killed between iterations: the next iteration raises
    SliceLost naming the sampler slice (no hang, no raw Ray error); the learner's
    weights are still there to read."""
    client = connect()
    try:
        loop = RLLoop(client, RLConfig(rows=8), learner=0, sampler=1)
        loop.step().fetch(timeout_s=120)
        fleet.remove_host(loop.sampler, 0)
        with pytest.raises(SliceLost) as err:
            for _ in range(3):  # the loss is seen within a step or two
                loop.step().fetch(timeout_s=120)
        assert err.value.slice == loop.sampler
        assert not isinstance(err.value, ray.exceptions.RayError)
        assert all(np.isfinite(w).all() for w in _weights(loop.params))
    finally:
        client.close()
