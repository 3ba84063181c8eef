"""The chip worker's end of its command stream (``ChannelServer``): it checks the
secret, runs each batch through its handler in order, acknowledges and heartbeats,
and relays every batch to the workers below it (``fanout.py``). The framing and
the protocol are described in ``channel.py``."""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable

from pathways_ray.errors import WaitTimeout
from pathways_ray.transport.channel import (
    _LEN,
    HEARTBEAT_S,
    REPORT,
    SILENT_S,
    TOKEN_BYTES,
    CommandChannel,
    _ready,
    _recv_exact,
    recv_msg,
    send_msg,
)

logger = logging.getLogger(__name__)

__all__ = ["ChannelServer"]


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
