"""The command stream (no Ray): order, acks, backpressure, the secret, reconnects."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pathways_ray.channel import ChannelServer, CommandChannel, dumps
from pathways_ray.errors import WorkerDied


@pytest.fixture
def server():
    seen: list = []
    gate = threading.Event()
    gate.set()

    def handler(batch):
        gate.wait(10)
        seen.append(batch)

    srv = ChannelServer("127.0.0.1", handler)
    srv.seen, srv.gate = seen, gate
    yield srv
    srv.close()


def test_batches_run_in_order_and_are_acknowledged(server):
    ch = CommandChannel(server.address, server.token, timeout_s=10)
    for i in range(100):
        ch.send(dumps([("run", i)]), max_inflight=4)
    ch.wait_acked(ch.sent)
    assert ch.acked == 100
    assert server.seen == [[("run", i)] for i in range(100)]
    server.wait_for(100, 1)
    ch.close()


def test_a_big_batch_arrives_whole(server):
    blob = bytes(range(256)) * 40_000  # 10 MB, a program's bytes
    ch = CommandChannel(server.address, server.token, timeout_s=10)
    ch.send(dumps([("load", "fp", blob)]))
    ch.wait_acked(1)
    assert server.seen[0][0][2] == blob
    ch.close()


def test_backpressure_waits_for_the_worker_and_says_when_it_gives_up(server):
    server.gate.clear()  # the worker is busy
    ch = CommandChannel(server.address, server.token, timeout_s=0.5)
    ch.send(dumps([1]), max_inflight=1)  # one batch may be outstanding
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ran 0 of 1 command batches; no progress within 0.5 s"):
        ch.send(dumps([2]), max_inflight=1)
    assert time.monotonic() - t0 < 5
    server.gate.set()
    ch.close()


def test_wait_for_has_a_deadline_that_names_it(server):
    with pytest.raises(TimeoutError, match=r"reached batch 0, not 3, within 0.2 s"):
        server.wait_for(3, 0.2)


def test_a_connection_without_the_secret_runs_nothing(server):
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(b"x" * 32)
        s.sendall(dumps([("run", "evil")]))
        try:
            assert s.recv(8) == b""  # closed on us
        except ConnectionResetError:
            pass  # closed with our batch unread
    ch = CommandChannel(server.address, server.token, timeout_s=10)  # the real one still works
    ch.send(dumps(["ok"]))
    ch.wait_acked(1)
    assert server.seen == [["ok"]]
    ch.close()


def test_a_new_controller_reconnects_and_the_count_restarts(server):
    first = CommandChannel(server.address, server.token, timeout_s=10)
    first.send(dumps(["a"]))
    first.wait_acked(1)
    first.close()
    second = CommandChannel(server.address, server.token, timeout_s=10)
    second.send(dumps(["b"]))
    second.wait_acked(1)
    assert second.acked == 1
    assert server.seen == [["a"], ["b"]]
    second.close()


def test_a_handler_error_does_not_stop_the_stream():
    seen = []

    def handler(batch):
        if batch == ["boom"]:
            raise RuntimeError("boom")
        seen.append(batch)

    srv = ChannelServer("127.0.0.1", handler)
    ch = CommandChannel(srv.address, srv.token, timeout_s=10)
    for b in (["a"], ["boom"], ["c"]):
        ch.send(dumps(b))
    ch.wait_acked(3)
    assert seen == [["a"], ["c"]]
    ch.close()
    srv.close()


def test_a_worker_that_dies_is_named():
    srv = ChannelServer("127.0.0.1", lambda batch: None)
    ch = CommandChannel(srv.address, srv.token, timeout_s=10, what="chip worker rank 3 of s")
    ch.send(dumps(["a"]))
    ch.wait_acked(1)
    srv.close()  # the worker's process is gone: its end of the stream closes
    with pytest.raises(WorkerDied, match=r"command stream to chip worker rank 3 of s at "
                                         r"127\.0\.0\.1:\d+ broke after \d+ batches"):
        for _ in range(100):  # the first sends may still land in the kernel's buffer
            ch.send(dumps(["b"]), max_inflight=1)
    ch.close()


def test_a_dead_worker_shows_at_the_next_send_not_after_the_inflight_window():
    """Without backpressure due (max_inflight not reached), the send after the worker's
    end closed already raises: the controller learns of a dead host at its next batch,
    not after eight more batches went into a dead socket's buffer. A send with no ack
    waiting costs no blocking read."""
    srv = ChannelServer("127.0.0.1", lambda batch: None)
    ch = CommandChannel(srv.address, srv.token, timeout_s=10, what="chip worker rank 0 of s")
    ch.send(dumps(["a"]), max_inflight=8)
    deadline = time.monotonic() + 5
    while ch.acked < 1 and time.monotonic() < deadline:
        ch.poll()  # non-blocking
    assert ch.acked == 1
    srv.close()
    time.sleep(0.2)  # the close (FIN) reaches this end
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="rank 0 of s"):
        ch.send(dumps(["b"]), max_inflight=8)
    assert time.monotonic() - t0 < 1
    ch.close()
