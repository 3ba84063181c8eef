"""A chip handing its buffers over to the next world (``export_buffers``), on the one
local CPU device: no fleet, no Ray cluster."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pathways_ray.chips.executor import Failed
from pathways_ray.chips.shards import CarriedBuffers


class _Chip(CarriedBuffers):
    """The part of a ``ChipWorker`` that ``export_buffers`` reads."""

    rank = 0

    def __init__(self, buffers: dict):
        self.executor = SimpleNamespace(buffers=buffers)

    def _check_lease(self, lease):
        pass

    def _after(self, batches):
        pass


@pytest.mark.parametrize("settle_s", [None, 0.2], ids=["re-meshed", "after-a-loss"])
def test_a_donated_buffer_is_handed_over_as_deleted_and_the_rest_as_they_are(settle_s):
    """A program that took an input as donated deleted it on the chip; the client's
    delete of its handle may not have arrived when the world is re-formed (MaxText's
    train step donates its state). The chip's other buffers still go over."""
    import jax
    import jax.numpy as jnp

    kept = jnp.arange(6.0).reshape(2, 3)
    donated = jax.jit(lambda x: x + 1, donate_argnums=0)(jnp.ones(3))
    step_input = jnp.zeros(3)
    step_input.delete()
    carried = _Chip({1: kept, 2: donated, 3: step_input}).export_buffers(
        settle_s=settle_s, lost="v6e-2x2-1")
    np.testing.assert_array_equal(carried[1].shard, np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(carried[2].shard, np.full(3, 2.0))
    failed = carried[3].failed
    assert isinstance(failed, Failed) and "deleted (donated" in str(failed.exception())
