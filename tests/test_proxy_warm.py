"""``proxy.warm.WarmClients``: a client made before the session that takes it, handed on
emptied, closed when it is not (pure: the clients here are plain objects with the
four things the pool reads of a ``Client``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pathways_ray.proxy.warm import WarmClients, is_clean


class _Client:
    made = 0

    def __init__(self, buffers: int = 0):
        _Client.made += 1
        self.number = _Client.made
        self.slices = [SimpleNamespace(name="s0"), SimpleNamespace(name="s1")]
        self.live = {"s0", "s1"}
        self.buffers = buffers
        self.closed = False

    def describe(self):
        if self.closed:
            raise RuntimeError("closed")
        return [{"name": n} for n in sorted(self.live)]

    def stats(self):
        return {n: {"live_arrays": 0, "workers": [{"buffers": self.buffers}] * 4}
                for n in self.live}

    def close(self):
        self.closed = True


def _pool(delay: float = 0.0, **kw) -> tuple[WarmClients, list]:
    calls: list = []

    def connect(**options):
        calls.append(options)
        time.sleep(delay)
        return _Client()

    return WarmClients(connect, **kw), calls


def test_the_first_session_takes_the_client_made_at_start_and_the_next_the_same_one():
    pool, calls = _pool()
    pool.start()
    first = pool.take()  # waits for the one being made
    assert calls == [{"reserve_timeout_s": 30.0}]  # made ahead: gives up on busy slices
    pool.give_back(first, healthy=True)
    assert pool.take() is first and not first.closed
    assert pool.counts["taken_warm"] == 2 and pool.counts["connected_cold"] == 0
    assert len(calls) == 1


def test_a_client_with_buffers_left_or_a_lost_slice_is_closed_and_another_made_ahead():
    pool, calls = _pool()
    pool.start()
    a = pool.take()
    a.buffers = 3  # a session's array still on a chip
    pool.give_back(a, healthy=True)
    assert a.closed
    b = pool.take()  # the one made ahead once a was closed
    assert b is not a and len(calls) == 2
    pool.give_back(b, healthy=False)  # the session saw a slice lost
    assert b.closed
    c = pool.take()
    c.live = {"s0"}  # lost while it waited for a session
    pool.give_back(c)
    assert c.closed
    d = pool.take()
    pool.give_back(d)
    d.live = {"s0"}
    e = pool.take()  # d lost a slice after it came back: closed, a new one connected
    assert d.closed and e is not d
    pool.close()


def test_a_second_session_at_once_connects_its_own_and_only_one_is_kept():
    pool, calls = _pool()
    pool.start()
    a, b = pool.take(), pool.take()
    assert a is not b and pool.counts == {**pool.counts, "taken_warm": 1, "connected_cold": 1}
    assert calls[1] == {}  # a session's own connect: the usual reservation timeout
    pool.give_back(a)
    pool.give_back(b)
    assert not a.closed and b.closed  # one is kept: the other's slices go back
    pool.close()
    assert a.closed


def test_off_it_connects_per_session_and_closes_at_the_end():
    pool, calls = _pool(enabled=False)
    pool.start()
    assert calls == []
    a = pool.take()
    pool.give_back(a)
    assert a.closed and pool.take() is not a


def test_closing_while_one_is_being_made_closes_it_when_it_arrives():
    made = []

    def connect(**options):
        time.sleep(0.3)
        made.append(_Client())
        return made[-1]

    pool = WarmClients(connect)
    pool.start()
    pool.close()  # waits for the one being made
    assert len(made) == 1 and made[0].closed


def test_a_session_waits_for_the_one_being_made_rather_than_racing_it_for_slices():
    pool, calls = _pool(delay=0.5)
    pool.start()
    got = []
    t = threading.Thread(target=lambda: got.append(pool.take()))
    t.start()
    t.join(10)
    assert got and len(calls) == 1 and pool.counts["taken_warm"] == 1


@pytest.mark.parametrize("stats, clean", [
    ({}, False),
    ({"s0": {"live_arrays": 0, "workers": [{"buffers": 0}]}}, True),
    ({"s0": {"live_arrays": 1, "workers": [{"buffers": 0}]}}, False),
    ({"s0": {"live_arrays": 0, "workers": [{"buffers": 0}, {}]}}, False),
])
def test_clean_means_no_array_and_no_buffer_anywhere(stats, clean):
    assert is_clean(stats) is clean
