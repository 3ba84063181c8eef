"""Slice health without Ray: the stall decision, and the monitor on real command streams
(a server that closes, one that stops acknowledging)."""

from __future__ import annotations

import threading
import time

from pathways_ray.channel import ChannelServer, CommandChannel, dumps
from pathways_ray.health import HealthMonitor, stall_verdict


def test_stall_verdict():
    """Idle is fine however long; outstanding work is judged by the step deadline, or
    by the compile deadline while a batch that loads a program is outstanding."""
    assert stall_verdict(5, 5, 1e6, False, 10, 100) is None
    assert stall_verdict(6, 5, 9.9, False, 10, 100) is None
    why = stall_verdict(6, 5, 10.5, False, 10, 100)
    assert "no progress for 10 s" in why and "PATHWAYS_RAY_STEP_TIMEOUT_S" in why
    assert stall_verdict(6, 5, 50, True, 10, 100) is None
    assert "COMPILE" in stall_verdict(6, 5, 101, True, 10, 100)
    # A stream whose batches took 4 s each gets 5 x 4 s before it counts as frozen.
    assert stall_verdict(6, 5, 15, False, 10, 100, slowest_batch_s=4.0) is None
    assert "limit 20 s" in stall_verdict(6, 5, 21, False, 10, 100, slowest_batch_s=4.0)


def _watch(channels, **kw):
    condemned: dict[str, tuple[float, str]] = {}

    def condemn(name, reason):
        condemned.setdefault(name, (time.monotonic(), reason))

    mon = HealthMonitor(lambda: [(n, ch, 0) for n, ch in channels], condemn,
                        interval_s=0.05, **kw)
    return mon, condemned


def test_a_closed_stream_is_condemned_within_a_look():
    """A worker whose process dies closes its stream: condemned within ~2 looks, though
    nothing was sent to it since (no send needed to notice)."""
    srv = ChannelServer("127.0.0.1", lambda batch: None)
    ok_srv = ChannelServer("127.0.0.1", lambda batch: None)
    ch = CommandChannel(srv.address, srv.token, timeout_s=10, what="rank 0 of a")
    ok = CommandChannel(ok_srv.address, ok_srv.token, timeout_s=10, what="rank 0 of b")
    ch.send(dumps(["x"]), max_inflight=1)
    mon, condemned = _watch([("a", ch), ("b", ok)], step_timeout_s=60, compile_timeout_s=60)
    try:
        time.sleep(0.3)
        assert condemned == {}
        srv.close()
        deadline = time.monotonic() + 3
        while "a" not in condemned and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "closed" in condemned["a"][1] and "rank 0 of a" in condemned["a"][1]
        assert "b" not in condemned
    finally:
        mon.stop()
        for c in (ch, ok):
            c.close()
        ok_srv.close()


def test_a_stream_that_stops_acknowledging_is_condemned_after_the_deadline():
    """A frozen worker keeps its socket open and stops acking: condemned once its
    outstanding batch is older than the step deadline, not before; an idle one never."""
    gate = threading.Event()
    srv = ChannelServer("127.0.0.1", lambda batch: gate.wait(10))
    idle_srv = ChannelServer("127.0.0.1", lambda batch: None)
    ch = CommandChannel(srv.address, srv.token, timeout_s=10, what="rank 2 of a")
    idle = CommandChannel(idle_srv.address, idle_srv.token, timeout_s=10, what="rank 0 of b")
    idle.send(dumps(["x"]), max_inflight=0)
    mon, condemned = _watch([("a", ch), ("b", idle)], step_timeout_s=0.5,
                            compile_timeout_s=60)
    try:
        time.sleep(0.7)
        assert condemned == {}, "idle streams are fine"
        sent_at = time.monotonic()
        ch.send(dumps(["stuck"]))
        deadline = time.monotonic() + 3
        while "a" not in condemned and time.monotonic() < deadline:
            time.sleep(0.02)
        at, reason = condemned["a"]
        assert 0.5 - 0.05 <= at - sent_at < 1.5, at - sent_at  # within one look (0.05 s)
        assert "no progress" in reason and "rank 2 of a" in reason
        assert "b" not in condemned
    finally:
        gate.set()
        mon.stop()
        for c in (ch, idle):
            c.close()
        srv.close()
        idle_srv.close()


def test_abort_wakes_a_blocked_wait():
    """abort() from another thread ends a wait blocked on a frozen worker at once."""
    import pytest

    from pathways_ray.errors import WorkerDied

    gate = threading.Event()
    srv = ChannelServer("127.0.0.1", lambda batch: gate.wait(10))
    ch = CommandChannel(srv.address, srv.token, timeout_s=30, what="rank 1 of a")
    ch.send(dumps(["stuck"]))
    threading.Timer(0.2, ch.abort).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDied):
        ch.wait_acked(1)
    assert time.monotonic() - t0 < 2
    gate.set()
    ch.close()
    srv.close()
