"""The command stream (no Ray): order, acks, backpressure, the secret, reconnects."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pathways_ray.errors import WorkerDied
from pathways_ray.transport.channel import CommandChannel, dumps
from pathways_ray.transport.server import ChannelServer


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


# ---- relaying (fanout.py): one stream into a tree of workers ----------------------------
def _tree(n: int, gates: dict | None = None):
    """Worker 0 relays to 1 and 2; worker 1 relays to 3 (a host leader below the root)."""
    seen = {i: [] for i in range(n)}
    gates = gates or {}

    def handler_of(i):
        def handler(batch):
            if i in gates:
                gates[i].wait(30)
            seen[i].append(batch)
        return handler

    servers = [ChannelServer("127.0.0.1", handler_of(i)) for i in range(n)]
    ends = [(i, s.address, s.token) for i, s in enumerate(servers)]
    servers[1].relay([ends[3]], "slice t", timeout_s=10)
    servers[0].relay([ends[1], ends[2]], "slice t", timeout_s=10)
    return servers, seen


def test_a_relayed_stream_reaches_every_worker_in_order_and_acks_for_the_whole_tree():
    gates = {3: threading.Event()}  # the deepest worker is slow
    servers, seen = _tree(4, gates)
    ch = CommandChannel(servers[0].address, servers[0].token, timeout_s=10)
    try:
        for i in range(20):
            ch.send(dumps([("run", i)]))
        time.sleep(0.3)
        ch.poll()
        assert ch.acked == 0, "the root acknowledged batches that a worker below had not run"
        assert len(seen[0]) == len(seen[1]) == len(seen[2]) == 20 and seen[3] == []
        gates[3].set()
        ch.wait_acked(20)
        for i in range(4):
            assert seen[i] == [[("run", k)] for k in range(20)]
            servers[i].wait_for(20, 1)  # every worker counts the same batches (queries)
        for i in range(50):  # backpressure holds through the tree
            ch.send(dumps([i]), max_inflight=2)
            assert ch.sent - ch.acked <= 3
    finally:
        ch.close()
        for s in servers:
            s.close()


def test_a_worker_below_a_relay_that_dies_is_reported_by_rank():
    servers, _ = _tree(4)
    ch = CommandChannel(servers[0].address, servers[0].token, timeout_s=10, what="rank 0")
    try:
        ch.send(dumps([1]))
        ch.wait_acked(1)
        servers[3].close()  # the worker two hops down dies
        t0 = time.monotonic()
        while not ch.probe()[0]:
            assert time.monotonic() - t0 < 5, "the monitor never saw the death below the root"
            time.sleep(0.05)
        assert ch.blame and "chip worker rank 3" in ch.blame
        with pytest.raises(WorkerDied, match="chip worker rank 3"):
            for i in range(10):
                ch.send(dumps([i]))
                time.sleep(0.05)
    finally:
        ch.close()
        for s in servers:
            s.close()


def _serve_in_process(conn):
    """A worker in a process of its own (so that it can be frozen and killed for real)."""
    srv = ChannelServer("127.0.0.1", lambda batch: None)
    conn.send((srv.address, srv.token))
    conn.recv()  # until the test ends


def test_a_frozen_worker_below_a_relay_silences_the_root_and_a_killed_one_is_named():
    import multiprocessing
    import os
    import signal

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve_in_process, args=(there,), daemon=True)
    proc.start()
    address, token = here.recv()
    root = ChannelServer("127.0.0.1", lambda batch: None)
    root.relay([(5, address, token)], "slice t", timeout_s=10)
    ch = CommandChannel(root.address, root.token, timeout_s=10, what="rank 0")
    try:
        ch.send(dumps([0]))
        ch.wait_acked(1)
        os.kill(proc.pid, signal.SIGSTOP)
        ch.send(dumps([1]))
        time.sleep(1.5)  # the relay notices the silence below it (SILENT_S)
        _, progress, frames0 = ch.probe()
        time.sleep(1.5)  # three heartbeat periods
        closed, progress1, frames1 = ch.probe()
        assert not closed and progress == progress1 == 1
        assert frames1 == frames0, "the root kept heartbeating while a worker below it froze"
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while not ch.probe()[0]:
            assert time.monotonic() - t0 < 5, "the killed worker below the root went unseen"
            time.sleep(0.05)
        assert "chip worker rank 5" in ch.blame
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        ch.close()
        root.close()


def test_listening_tells_a_killed_worker_at_once_and_a_frozen_one_still_listens():
    """What the controller asks first when a slice is lost (``Slice.health``):
    the killed process's port refuses at once, the frozen one's kernel still accepts,
    and the probe does not disturb a live stream (the server drops it later, unread)."""
    import multiprocessing
    import os
    import signal

    from pathways_ray.transport.channel import listening

    ctx = multiprocessing.get_context("spawn")
    procs, pipes, addresses = [], [], []
    for _ in range(2):
        here, there = ctx.Pipe()  # (kept open: the worker serves until it closes)
        proc = ctx.Process(target=_serve_in_process, args=(there,), daemon=True)
        proc.start()
        procs.append(proc)
        pipes.append(here)
        addresses.append(here.recv())
    live = ChannelServer("127.0.0.1", lambda batch: None)
    ch = CommandChannel(live.address, live.token, timeout_s=10, what="rank 0")
    try:
        ch.send(dumps([0]))
        ch.wait_acked(1)
        os.kill(procs[0].pid, signal.SIGSTOP)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(5)
        t0 = time.monotonic()
        up = listening([live.address, addresses[0][0], addresses[1][0]], timeout_s=5)
        assert up == [True, True, False]
        assert time.monotonic() - t0 < 1, "a refused port must not wait for the timeout"
        ch.send(dumps([1]))  # the live stream goes on
        ch.wait_acked(2)
        assert listening([], timeout_s=1) == []
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
        ch.close()
        live.close()


def test_a_put_travels_in_its_command_while_every_chip_receiving_it_stays_small():
    """A put rides inside its command (no Ray object, no call per chip) when its blocks
    are 64 KiB at most, or when every chip receiving all of them stays within 1 MiB: a
    256 KiB batch on 4 chips does; the same per chip on 64 chips, 16 MiB, does not."""
    import numpy as np

    from pathways_ray.programs.sharding import MeshShape, shard_slices, unique_shards
    from pathways_ray.transport.commands import Inline, put_pieces

    def pieces(nbytes: int, chips: int):
        x = np.zeros(nbytes // 4, np.float32)
        mesh = MeshShape(("data",), (chips,))
        index = shard_slices(x.shape, mesh, (("data",),))
        objects = []
        out, size = put_pieces(x, index, unique_shards(index), chips,
                               lambda b: objects.append(b) or len(objects))
        assert size == nbytes
        return out, objects

    batch, objects = pieces(256 << 10, 4)
    assert isinstance(batch, Inline) and not objects
    assert [b.nbytes for b in batch.blocks] == [64 << 10] * 4 and batch.of_rank == (0, 1, 2, 3)
    small, objects = pieces(32 << 10, 64)  # 32 KiB to each of 64 chips: 2 MiB, but small
    assert isinstance(small, Inline) and not objects
    wide, objects = pieces(16 << 20, 64)  # one object per chip's block, none inline
    assert not isinstance(wide, Inline) and len(objects) == 64
    assert [ref for ((ref, _),) in wide] == list(range(1, 65))
