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
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from pathways_ray.errors import WaitTimeout, WorkerDied

logger = logging.getLogger(__name__)

__all__ = ["ChannelServer", "CommandChannel"]

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


class ChannelServer:
    """Worker side: accepts the controller's connection and runs what it sends.

    ``handler(batch)`` runs every batch in arrival order, on the server's
    thread. ``wait_for(n, timeout_s)`` blocks until ``n`` batches of the
    current connection have run. A new connection (a new controller) restarts
    the count.
    """

    def __init__(self, host: str, handler: Callable[[list], None]):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._handler = handler
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._done = 0
        self._cond = threading.Condition()
        self._closed = False
        self._conn: socket.socket | None = None
        self._busy = False  # a batch is running
        self._send_lock = threading.Lock()  # acks and heartbeats share the stream
        self._children: list[CommandChannel] = []  # the workers this one relays to
        self._dead: set[int] = set()  # children whose stream closed (reported upstream)
        self._acked_up = 0  # the count last acknowledged upstream
        self._watching = False  # the thread that reads the children's acks runs
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="pathways-ray-commands")
        self._thread.start()
        threading.Thread(target=self._beat, daemon=True, name="pathways-ray-heartbeat").start()

    # ---- relaying ------------------------------------------------------------------
    def relay(self, children: list[tuple[int, tuple[str, int], bytes]], what: str,
              timeout_s: float) -> None:
        """Forward every batch from now on to ``children`` (``(rank, address, secret)``
        of their servers) before running it; call before the controller connects."""
        chans = [CommandChannel(address, token, timeout_s=timeout_s,
                                what=f"chip worker rank {rank} of {what}", rank=rank)
                 for rank, address, token in children]
        with self._cond:
            old, self._children = self._children, chans
            self._dead = set()
        for ch in old:
            ch.close()
        if chans and not self._watching:
            self._watching = True
            threading.Thread(target=self._watch_children, daemon=True,
                             name="pathways-ray-relay").start()

    def _forward(self, payload: bytes) -> None:
        chans = self._children
        for i, ch in enumerate(chans):
            if i in self._dead:
                continue
            try:
                if ch.sent == ch.acked:
                    ch.heard = time.monotonic()  # silence counts from when work is due
                send_msg(ch._sock, payload)
                ch.sent += 1
            except (OSError, ValueError):
                self._child_died(chans, i)

    def _child_died(self, chans: list, i: int) -> None:
        """Child ``i`` of ``chans`` closed its stream, or reported a death below it: pass
        the rank of the worker that died upstream, once."""
        with self._cond:
            if chans is not self._children or i in self._dead:
                return  # (the stream was set up again, or ended, meanwhile)
            self._dead.add(i)
        ch = chans[i]
        rank = ch.rank if ch.lost_rank is None else ch.lost_rank
        if self._conn is None or self._closed:
            return  # the stream is ending anyway (the controller left first)
        logger.warning("chip worker rank %s (relayed from here) closed its command stream: "
                       "reporting it upstream", rank)
        self._send_up(REPORT | rank)

    def _subtree_done(self) -> int:
        """Batches that this worker and every worker below it have run."""
        return min([self._done, *(ch.acked for ch in self._children)])

    def _send_up(self, value: int) -> None:
        conn = self._conn
        if conn is None:
            return
        with self._send_lock:
            try:
                conn.sendall(_LEN.pack(value))
            except OSError:
                pass  # the connection is going away; _serve_connection sees it

    def _ack_up(self) -> None:
        """Acknowledge upstream what the whole subtree ran, if that moved."""
        with self._send_lock:
            done, conn = self._subtree_done(), self._conn
            if done <= self._acked_up or conn is None:
                return
            self._acked_up = done
            try:
                conn.sendall(_LEN.pack(done))
            except OSError:
                pass

    def _watch_children(self) -> None:
        """Read the children's acks and heartbeats; pass progress upstream."""
        while not self._closed:
            chans = self._children
            live = {ch._sock: i for i, ch in enumerate(chans) if i not in self._dead}
            if not live:
                time.sleep(HEARTBEAT_S)
                continue
            poller = select.poll()
            by_fd = {}
            try:
                for sock, i in live.items():
                    poller.register(sock, select.POLLIN)
                    by_fd[sock.fileno()] = i
                readable = [by_fd[fd] for fd, _ in poller.poll(HEARTBEAT_S * 1000)]
            except (OSError, ValueError):
                time.sleep(0.05)  # a child's socket closed under us (relay() replaced it)
                continue
            now = time.monotonic()
            for i in readable:
                try:
                    chans[i]._read_acks(block=False)
                    chans[i].heard = now
                except (OSError, ValueError):  # ConnectionError included
                    self._child_died(chans, i)
            if readable:
                self._ack_up()

    def _relayed_quiet(self) -> bool:
        """A child with work outstanding has been silent past ``SILENT_S``."""
        now = time.monotonic()
        return any(ch.sent > ch.acked and now - ch.heard > SILENT_S
                   for i, ch in enumerate(self._children) if i not in self._dead)

    def _beat(self) -> None:
        """While a batch runs here or below, repeat the count every ``HEARTBEAT_S``
        (skipped when the controller is not reading: a full send buffer must not stall
        acks; and while a worker below is silent, so that silence reaches the top)."""
        while not self._closed:
            time.sleep(HEARTBEAT_S)
            conn = self._conn
            busy = self._busy or any(ch.sent > ch.acked for ch in self._children)
            if not busy or conn is None or self._relayed_quiet():
                continue
            with self._send_lock:
                try:
                    if _ready(conn, select.POLLOUT):
                        conn.sendall(_LEN.pack(self._acked_up))
                except (OSError, ValueError):
                    pass  # the connection is going away; _serve_connection sees it

    def wait_for(self, n: int, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done >= n or self._closed,
                                       timeout=timeout_s):
                raise WaitTimeout(f"the command stream reached batch {self._done}, not {n}, "
                                  f"within {timeout_s:g} s ($PATHWAYS_RAY_STREAM_TIMEOUT_S)")

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            try:
                presented = _recv_exact(conn, TOKEN_BYTES)
            except (OSError, ConnectionError):
                conn.close()
                continue
            if not hmac.compare_digest(presented, self.token):
                logger.warning("refused a command connection from %s: wrong token", peer)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                self._done = 0
                self._acked_up = 0
                self._conn = conn
            self._serve_connection(conn)

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            while True:
                payload = recv_msg(conn)
                if self._children:
                    self._forward(payload)  # they start while this one unpickles
                batch = pickle.loads(payload)
                self._busy = True
                try:
                    self._handler(batch)
                except Exception:  # noqa: BLE001 - the executor records its own failures
                    logger.exception("command batch failed")
                finally:
                    self._busy = False
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()
                self._ack_up()
        except (OSError, ConnectionError, EOFError):
            pass  # the controller went away; wait for the next one
        finally:
            conn.close()
            with self._cond:
                if self._conn is conn:
                    self._conn = None
                children, self._children = self._children, []
            for ch in children:  # the stream below ends with this one (a new controller
                ch.close()       # sets up its relays again)

    def close(self, join_s: float = 0.0) -> None:
        """Stop serving. ``join_s``: wait that long for a batch still running to end
        (so that nothing it writes lands after the caller moves on)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for ch in self._children:
            ch.abort()  # a forward blocked on a frozen child returns
            ch.close()
        for s in (self._sock, self._conn):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        if join_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(join_s)
            if self._thread.is_alive():
                logger.warning("a command batch was still running %g s after its stream "
                               "closed", join_s)


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


def dumps(batch: list) -> bytes:
    return pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
