"""Elastic decisions, pure (no Ray): who runs which micro-batch, when to stop, how many
slices to ask for."""

from __future__ import annotations

import pytest

from pathways_ray.elastic.elastic_policy import (
    NotEnoughSlices,
    assign_microbatches,
    check_failure,
    recovery_source,
    snapshot_due,
    want_more,
)
from pathways_ray.programs.sharding import MeshShape, shard_slices, spread_shards


def test_micro_batches_spread_round_robin_and_keep_their_count():
    """N slices take one each; N-1 share them unevenly, in order; the count never
    changes (so shapes, programs and the summation order stay those of the start)."""
    assert assign_microbatches(3, ["a", "b", "c"]) == ["a", "b", "c"]
    assert assign_microbatches(3, ["a", "c"]) == ["a", "c", "a"]
    assert assign_microbatches(4, ["b"]) == ["b"] * 4
    with pytest.raises(ValueError, match=r"live=\[\]"):
        assign_microbatches(3, [])


def test_failure_policy_names_what_was_lost_and_the_setting():
    check_failure(["a", "c"], ["b"], min_slices=2, failures=1, max_failures=None)
    with pytest.raises(NotEnoughSlices, match=r"lost slice\(s\) \['b'\]: 1 left.*min_slices=2"):
        check_failure(["a"], ["b"], min_slices=2, failures=2, max_failures=None)
    with pytest.raises(NotEnoughSlices, match="max_failures=1"):
        check_failure(["a", "c"], ["b"], min_slices=1, failures=2, max_failures=1)


def test_grow_back_counts_slices_on_their_way():
    assert want_more(live=2, target=3, joining=0) == 1
    assert want_more(live=2, target=3, joining=1) == 0
    assert want_more(live=3, target=3, joining=0) == 0


def test_snapshots_fall_due_every_n_steps_and_can_be_off():
    assert [s for s in range(1, 31) if snapshot_due(s, 10)] == [10, 20, 30]
    assert not any(snapshot_due(s, None) or snapshot_due(s, 0) for s in range(20))
    assert not snapshot_due(0, 1)
    with pytest.raises(ValueError, match="snapshot_every=-1"):
        snapshot_due(5, -1)


def test_a_survivors_replica_comes_before_the_snapshot():
    assert recovery_source(["a"], 10, 13, 10) == ("replica", 0)
    assert recovery_source([], 10, 13, 10) == ("snapshot", 3)
    with pytest.raises(NotEnoughSlices, match="no snapshot had completed"):
        recovery_source([], None, 3, 10)
    with pytest.raises(NotEnoughSlices, match=r"snapshots are off \(snapshot_every=None\)"):
        recovery_source([], None, 3, None)


def test_a_snapshot_sends_every_block_once_spread_over_the_chips():
    """Replicated arrays come from all four chips, not all from rank 0; a sharded
    array's blocks each come once, from the chip that holds it."""
    mesh = MeshShape(("data", "model"), (2, 2))
    arrays = [((8, 8), 4, mesh, ((), ()))] * 4 + [((8, 8), 4, mesh, (("data",), ("model",)))]
    plan = spread_shards(arrays)
    assert sorted(plan) == [0, 1, 2, 3]
    replicated = [r for r, blocks in plan.items() for pos, _ in blocks if pos < 4]
    assert sorted(replicated) == [0, 1, 2, 3]
    sharded = {r: b for r, blocks in plan.items() for pos, b in blocks if pos == 4}
    assert sharded == dict(enumerate(shard_slices((8, 8), mesh, (("data",), ("model",)))))
    cols = spread_shards([((4, 8), 4, mesh, ((), ("model",)))])  # 2 blocks, 2 holders each
    assert sum(len(b) for b in cols.values()) == 2 and len(cols) == 2
