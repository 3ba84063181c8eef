"""Chip-to-chip pulls (``pull.py``) over a real JAX transfer server, in this process:
what arrives, and how a wait ends when nothing comes (no Ray; milliseconds)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pathways_ray.transport.pull import Pull, Transfers, new_id, wait


@pytest.fixture(scope="module")
def ends():
    return Transfers("127.0.0.1"), Transfers("127.0.0.1")


def _offer(src: Transfers, uuid: int, arrays: list) -> Pull:
    src.offer(uuid, arrays, timeout_s=60)
    return Pull(src.address(), uuid, tuple((tuple(a.shape), str(a.dtype)) for a in arrays))


def test_a_pull_brings_every_piece_bit_for_bit(ends):
    import jax

    src, dst = ends
    host = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array(7, np.int32)]
    got = dst.start(_offer(src, new_id(), [jax.device_put(a) for a in host]))
    wait(got, 30, "the test's pieces")
    for a, b in zip(got, host, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_pull_that_is_never_offered_ends_at_its_deadline_or_when_abandoned(ends):
    import jax

    src, dst = ends
    x = jax.device_put(np.ones(4, np.float32))
    late = [new_id(), new_id()]
    pulls = [dst.start(Pull(src.address(), uuid, (((4,), "float32"),))) for uuid in late]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="the first.*0.3 s"):
        wait(pulls[0], 0.3, "the first")
    assert time.monotonic() - t0 < 5
    with pytest.raises(ConnectionError, match="lost the slice"):
        wait(pulls[1], 60, "the second", stopped=lambda: ConnectionError("lost the slice"))
    for uuid in late:  # offered after all: nothing is left pending in this process
        src.offer(uuid, [x], timeout_s=60)
    for got in pulls:
        wait(got, 30, "the late offers")
