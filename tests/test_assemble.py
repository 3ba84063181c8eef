"""Building a chip's block from the pieces that overlap it (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from pathways_ray.chips.executor import assemble


def test_one_exact_piece_is_used_as_is():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    block = (slice(0, 3), slice(0, 4))
    out = assemble(block, "float32", [(block, x)])
    assert np.shares_memory(out, x)  # no copy here; the device_put after it copies
    np.testing.assert_array_equal(out, x)


def test_a_block_inside_one_piece_is_a_view_of_it():
    """A finer sharding here (a quarter of the columns from a half): no copy yet."""
    half = np.arange(32, dtype=np.float32).reshape(4, 8)  # columns 8..16 of a 4x16 array
    block = (slice(0, 4), slice(12, 16))
    out = assemble(block, "float32", [((slice(0, 4), slice(8, 16)), half)])
    assert np.shares_memory(out, half)
    np.testing.assert_array_equal(out, half[:, 4:8])


def test_a_scalar_from_a_host_as_one_element_is_copied_into_shape():
    out = assemble((), "int32", [((), np.array([7], np.int32))])
    assert out.shape == () and int(out) == 7


def test_pieces_from_another_sharding_compose_the_block():
    full = np.arange(64, dtype=np.int32).reshape(8, 8)
    rows = [((slice(r, r + 2), slice(0, 8)), full[r:r + 2]) for r in range(0, 8, 2)]
    block = (slice(1, 7), slice(4, 8))
    np.testing.assert_array_equal(assemble(block, "int32", rows), full[1:7, 4:8])


def test_a_gap_is_an_error():
    block = (slice(0, 4),)
    with pytest.raises(ValueError, match="cover 2 of the 4 elements"):
        assemble(block, "float32", [((slice(0, 2),), np.zeros(2, np.float32))])


def test_a_pulled_device_array_that_is_the_block_becomes_the_shard_without_a_copy():
    import jax

    x = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4))
    block = (slice(2, 5), slice(0, 4))
    assert assemble(block, "float32", [(block, x)]) is x
    # Part of a pulled piece, or another dtype, goes through host memory as before.
    part = assemble((slice(2, 4), slice(0, 4)), "float32", [(block, x)])
    np.testing.assert_array_equal(part, np.asarray(x)[:2])
    assert assemble(block, "float64", [(block, x)]).dtype == np.float64
