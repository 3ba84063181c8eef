"""Slice health without Ray: the stall decision, and the monitor on real command streams
(a server that closes, one that stops acknowledging)."""

from __future__ import annotations

import threading
import time

from pathways_ray.controller.health import HealthMonitor, stall_verdict
from pathways_ray.transport.channel import CommandChannel, dumps
from pathways_ray.transport.server import ChannelServer


def test_stall_verdict():
    """Idle is fine however long. With work outstanding, silence past the step deadline
    is a frozen host; talking without progress is judged by the hang limit (the compile
    deadline, or 5 x the slowest batch seen)."""
    assert stall_verdict(5, 5, 1e6, 1e6, 10, 100) is None
    assert stall_verdict(6, 5, 9.9, 9.9, 10, 100) is None
    why = stall_verdict(6, 5, 10.5, 10.5, 10, 100)
    assert "silent for 10 s" in why and "PATHWAYS_RAY_STEP_TIMEOUT_S" in why
    assert "frozen" in why
    # Compiling, or waiting on a frozen peer: the worker talks, so it is not frozen.
    assert stall_verdict(6, 5, 50, 0.5, 10, 100) is None
    why = stall_verdict(6, 5, 101, 0.5, 10, 100)
    assert "no progress for 101 s" in why and "COMPILE" in why and "hangs" in why
    # A stream whose batches took 40 s each gets 5 x 40 s before it counts as hung.
    assert stall_verdict(6, 5, 150, 0.5, 10, 100, slowest_batch_s=40.0) is None
    assert "limit 200 s" in stall_verdict(6, 5, 201, 0.5, 10, 100, slowest_batch_s=40.0)


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


_SERVER = """
import sys, time
from pathways_ray.transport.server import ChannelServer
srv = ChannelServer("127.0.0.1", lambda batch: time.sleep(60))
print(srv.address[1], srv.token.hex(), flush=True)
sys.stdin.read()
"""


def test_a_frozen_worker_is_condemned_and_a_busy_one_is_not():
    """Two workers each run a batch that takes long. One keeps running (as a worker does
    while it compiles or waits on a peer): its heartbeats keep it alive past the step
    deadline. The other's process is frozen (SIGSTOP, a real one): it falls silent and
    is condemned once the step deadline passes, not before; an idle stream never is."""
    import os
    import signal
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    idle_srv = ChannelServer("127.0.0.1", lambda batch: None)
    channels = []
    try:
        for name, p in zip("ab", procs, strict=True):
            port, token = p.stdout.readline().split()
            channels.append((name, CommandChannel(("127.0.0.1", int(port)), bytes.fromhex(token),
                                                  timeout_s=10, what=f"rank 2 of {name}")))
        idle = CommandChannel(idle_srv.address, idle_srv.token, timeout_s=10, what="rank 0 of c")
        idle.send(dumps(["x"]), max_inflight=0)
        mon, condemned = _watch(channels + [("c", idle)], step_timeout_s=1.5,
                                compile_timeout_s=60)
        try:
            for _, ch in channels:
                ch.send(dumps(["long"]))
            time.sleep(0.7)  # both running, both heartbeating
            os.kill(procs[0].pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            time.sleep(3.5)
            at, reason = condemned["a"]
            assert 1.0 <= at - frozen_at < 3.0, at - frozen_at
            assert "silent" in reason and "frozen" in reason and "rank 2 of a" in reason
            assert "b" not in condemned and "c" not in condemned
        finally:
            mon.stop()
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(10)
        for _, ch in channels:
            ch.close()
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
