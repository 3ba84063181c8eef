"""Elastic decisions, pure (no Ray): who runs which micro-batch, when to stop, how many
slices to ask for."""

from __future__ import annotations

import pytest

from pathways_ray.elastic_policy import (
    NotEnoughSlices,
    assign_microbatches,
    check_failure,
    want_more,
)


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
