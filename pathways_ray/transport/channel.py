"""The command stream from the controller to one chip worker.

Each step's commands used to reach the workers as Ray actor calls, one per
worker per batch. A Ray call costs its callee about 1 ms of CPU and its caller
about 0.35 ms on a 2-core host (measured), taken from the chips' own CPU time
at every batch. A plain TCP connection per worker costs a few microseconds per
batch and blocks while idle (no busy polling, unlike Compiled Graph channels).

Only plain data travels here: batches of command tuples, pickled once per
slice. Object refs (the pieces of a ``put``) keep going through Ray calls,
which track their ownership; the worker waits for them when the stream
reaches the ``put``.

Security: the server accepts a connection only after it presents the
32-byte secret that the worker handed out over Ray's authenticated RPC, and
nothing is unpickled before that. Each batch is acknowledged with its running
count, which gives the controller backpressure and "everything up to batch N
has been run" for the queries that must follow the stream (fetch, ready).

Heartbeats: while a batch runs, the worker repeats its count every
``HEARTBEAT_S`` on the same stream. A worker that compiles, or waits for a
peer, keeps talking; a frozen one (SIGSTOP, a hung VM) falls silent, though its
kernel keeps the connection open. ``probe()`` counts the frames received, so the
health monitor tells the two apart (``health.py``) and blames the frozen slice,
not the slices waiting on it.

Relaying (``fanout.py``): a worker may forward every batch it receives to other
workers of its slice before running it. It then acknowledges a batch once it and
every worker below it have run it, heartbeats only while everyone below it is
heard from (a frozen chip anywhere below silences its whole branch, so the
controller's monitor sees the silence), and reports a worker below it whose
stream closed with a report frame (the top bit set, the rank below), which the
controller reads as that worker's death.

This module is the framing and the controller's end (``CommandChannel``);
``server`` is the chip worker's end and its relaying (``ChannelServer``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import pickle
import select
import socket
import struct
import time

from pathways_ray.errors import WaitTimeout, WorkerDied

logger = logging.getLogger(__name__)

__all__ = ["CommandChannel", "dumps", "listening", "recv_msg", "send_msg"]

_LEN = struct.Struct("!Q")
TOKEN_BYTES = 32
_TCP_ESTABLISHED = 1  # tcp_info.tcpi_state (linux/tcp_states.h)
HEARTBEAT_S = 0.5  # a busy worker's sign of life, this often
SILENT_S = 2 * HEARTBEAT_S  # a relayed worker this quiet with work outstanding: silence
REPORT = 1 << 63  # a frame with this bit is no count: "rank (the low bits) below me died"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_msg(sock: socket.socket, payload: bytes) -> None:
    header = _LEN.pack(len(payload))
    if len(payload) < 65536:
        sock.sendall(header + payload)  # one segment for the usual small batch
    else:
        sock.sendall(header)
        sock.sendall(payload)


def recv_msg(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return _recv_exact(sock, n)


class CommandChannel:
    """Controller side: one connection to one worker's ``ChannelServer``.

    ``what`` names the worker in errors. A broken connection (the worker or its
    host died) raises ``WorkerDied``; a worker that stops making progress raises
    ``WaitTimeout`` after ``timeout_s``.
    """

    def __init__(self, address: tuple[str, int], token: bytes, timeout_s: float = 600.0,
                 what: str = "a chip worker", rank: int | None = None):
        self.timeout_s = timeout_s
        self.what = what
        self.rank = rank
        self.blame: str | None = None  # a worker below this one (relayed) that died
        self.lost_rank: int | None = None  # its rank
        self.heard = time.monotonic()  # when a frame last came (kept by a relay)
        self._address = tuple(address)
        self.sent = 0
        self.acked = 0
        self._acks = b""  # a partial ack frame read so far
        self._received = 0  # bytes of acks and heartbeats read so far
        with self._broken():
            self._sock = socket.create_connection(self._address, timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(token)

    def send(self, payload: bytes, max_inflight: int | None = None) -> None:
        """Send one pickled batch; with ``max_inflight``, wait (up to ``timeout_s``)
        until at most that many sent batches have not run yet.

        Acks that already arrived are read first, without blocking: a worker that
        died closed its end, and that shows here, at the next send, rather than
        after ``max_inflight`` more batches went into a dead socket's buffer.
        """
        with self._broken():
            self._read_acks(block=False)
            send_msg(self._sock, payload)
        self.sent += 1
        if max_inflight is not None:
            self.wait_acked(self.sent - max_inflight)

    def wait_acked(self, n: int) -> None:
        """Wait until ``n`` batches have run; ``WaitTimeout`` if the count stops moving
        for ``timeout_s`` (heartbeats show the worker alive, not that it progresses)."""
        with self._broken(n):
            last, deadline = self.acked, time.monotonic() + self.timeout_s
            while self.acked < n:
                self._read_acks(block=True)
                if self.acked != last:
                    last, deadline = self.acked, time.monotonic() + self.timeout_s
                elif time.monotonic() > deadline:
                    raise TimeoutError

    def poll(self) -> None:
        """Read the acks that arrived, without blocking; ``WorkerDied`` if the worker's
        end is closed."""
        with self._broken():
            self._read_acks(block=False)

    def probe(self) -> tuple[bool, int, int]:
        """``(closed, batches run, frames heard)`` from another thread, consuming
        nothing: whether the worker's end of the stream is gone (Linux: the socket
        left ESTABLISHED), the acks read so far or waiting unread in the socket, and
        how many frames (acks and heartbeats) arrived so far: a count that stops
        moving while a batch is outstanding means a silent worker."""
        received = self._received
        try:
            state = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
            if state != _TCP_ESTABLISHED:
                return True, self.acked, received // _LEN.size
            if not _ready(self._sock):
                return False, self.acked, received // _LEN.size
            waiting = self._sock.recv(1 << 20, socket.MSG_PEEK)
        except OSError:
            return True, self.acked, received // _LEN.size
        latest, reported = _frames(self._acks + waiting)
        if reported is not None:
            self._blame(reported)
            return True, self.acked, received // _LEN.size
        return False, max(self.acked, latest or 0), (received + len(waiting)) // _LEN.size

    def _blame(self, rank: int) -> str:
        self.lost_rank = rank
        self.blame = (f"chip worker rank {rank}, which {self.what} relays to, closed its "
                      f"command stream: its process or host died")
        return self.blame

    def abort(self) -> None:
        """Break the stream from another thread: a send or a wait blocked on it returns
        at once with ``WorkerDied``."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read_acks(self, block: bool) -> None:
        while True:
            # (MSG_DONTWAIT would not do: a socket with a timeout polls before recv)
            if not block and not _ready(self._sock):
                return
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("the worker closed the stream")
            self._received += len(data)
            buf = self._acks + data
            whole = len(buf) - len(buf) % _LEN.size
            latest, reported = _frames(buf[:whole])
            if reported is not None:
                raise ConnectionError(self._blame(reported))
            if latest is not None:
                self.acked = latest
            self._acks = buf[whole:]
            if block:
                return

    @contextlib.contextmanager
    def _broken(self, waiting_for: int | None = None):
        try:
            yield
        except TimeoutError:  # an OSError too: test it first
            raise WaitTimeout(f"{self.what} ran {self.acked} of "
                              f"{self.sent if waiting_for is None else waiting_for} command "
                              f"batches; no progress within {self.timeout_s:g} s "
                              f"($PATHWAYS_RAY_STREAM_TIMEOUT_S)") from None
        except OSError as e:  # ConnectionError included
            raise WorkerDied(f"the command stream to {self.what} at "
                             f"{self._address[0]}:{self._address[1]} broke after "
                             f"{self.sent} batches ({e}); the worker or its host died") from e

    def close(self) -> None:
        try:
            self._sock.close()
        except (OSError, AttributeError):
            pass


def _ready(sock: socket.socket, event: int = select.POLLIN) -> bool:
    """Whether ``sock`` can be read (or written) now, without waiting. (poll, not
    select: select cannot look at descriptors above 1024, and a controller of
    thousands of chips holds more.)"""
    poller = select.poll()
    poller.register(sock, event)
    return bool(poller.poll(0))


def _frames(buf: bytes) -> tuple[int | None, int | None]:
    """The last count among the whole frames of ``buf``, and the rank of a report
    frame among them (a relayed worker that died), if any."""
    latest = reported = None
    for (value,) in _LEN.iter_unpack(buf[:len(buf) - len(buf) % _LEN.size]):
        if value & REPORT:
            reported = value & ~REPORT
        else:
            latest = value
    return latest, reported


def listening(addresses: list[tuple[str, int]], timeout_s: float) -> list[bool]:
    """Whether something still listens at each ``(host, port)``: one connect to each,
    all at once, closed unused. A killed process's port refuses at once, a lost
    machine's stays silent (``False`` after ``timeout_s``); a frozen process still
    counts as listening, for its kernel completes the handshake. A chip worker's
    ``ChannelServer`` takes such a connection only after its stream ends, and drops
    it for want of the secret."""
    socks: list[socket.socket | None] = []
    try:
        for host, port in addresses:
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            socks.append(s)
            s.setblocking(False)
            if s.connect_ex((host, port)) not in (0, errno.EINPROGRESS):
                s.close()
                socks[-1] = None
        pending = {s.fileno(): s for s in socks if s is not None}
        poller = select.poll()
        for fd in pending:
            poller.register(fd, select.POLLOUT)
        done: dict[int, bool] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(pending) and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                done[fd] = pending[fd].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        return [s is not None and done.get(s.fileno(), False) for s in socks]
    finally:
        for s in socks:
            if s is not None:
                s.close()


def dumps(batch: list) -> bytes:
    return pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
