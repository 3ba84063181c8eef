"""The client's dispatch queue: commands batched per placement, sent to the controller.

A batch goes out when it is full, when the client needs a result (``fetch``,
``block_until_ready``, a cross-slice reshard), or ``flush_interval_s`` after
its first command, from a background thread. Frees ride at the end of a batch.
The first command after a pause goes at once: the slice may be idle.

A batch's ``submit`` runs on the controller after the call that sent it has
returned, so what goes wrong there (a slice lost, the controller gone) is
found later: by the background thread, or at the next call. It is kept and
raised at the next call that touches that slice (``SliceLost``) or at the
next call of any kind (anything else); nothing raised in the background is
dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from pathways_ray import boundary
from pathways_ray.errors import PathwaysError, SliceLost
from pathways_ray.observability.profile_trace import Event
from pathways_ray.transport.commands import Command, Free

logger = logging.getLogger(__name__)

__all__ = ["Dispatcher"]

MAX_SUBMITTED = 32  # batches on their way to the controller before a sender waits


class Dispatcher:
    """Per-placement batches toward one controller, flushed by one background thread.

    ``died(exc)`` turns the death of the controller into the error to raise.
    """

    def __init__(self, controller, names: list[str], *, max_batch: int,
                 flush_interval_s: float, died: Callable[[BaseException], PathwaysError]):
        self._controller = controller
        self._died = died
        self.max_batch = max_batch
        self._flush_interval_s = flush_interval_s
        self._lock = threading.RLock()
        self._pending: dict[str, list[Command]] = {}
        self._frees: dict[str, list[int]] = {}
        self._last_flush: dict[str, float] = {}
        self._members: dict[str, frozenset[str]] = {}  # placement -> its slices
        self._grouped = False
        self._submitted: deque = deque()  # (placement, ref of its submit)
        self.lost: dict[str, SliceLost] = {}  # slice name -> why it is gone
        self._error: BaseException | None = None  # raised at the next call of any kind
        self.spans: list | None = None  # a span per batch sent, while a profile runs
        for name in names:
            self.add(name, [name])
        self._closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="pathways-ray-flush")
        self._thread.start()

    def add(self, name: str, members: list[str]) -> None:
        """A placement: a slice, or a multislice group of ``members``."""
        with self._lock:
            self._members[name] = frozenset(members)
            self._pending[name], self._frees[name] = [], []
            self._last_flush[name] = 0.0
            self._grouped = self._grouped or len(members) > 1

    # ---- errors ------------------------------------------------------------------
    def check(self, name: str | None = None) -> None:
        """Raise what is known to have gone wrong for placement ``name`` (or for
        everything): a lost slice of it, or an error from the background."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if name is not None and self.lost:
            for member in self._members.get(name, ()):
                if member in self.lost:
                    raise self.lost[member]

    def record(self, name: str, err: BaseException) -> BaseException:
        """Keep ``err`` (raised for placement ``name``): a lost slice for the calls that
        touch it, anything else for the next call. Returns it."""
        with self._lock:
            if isinstance(err, SliceLost):
                self.lost.setdefault(err.slice, err)
                self._pending[name].clear()  # nothing of it can run any more
            elif self._error is None:
                self._error = err
        return err

    def poll(self) -> None:
        """Collect the submits that finished with an error, without blocking."""
        with self._lock:
            if not self._submitted:
                return
            names = dict((ref, name) for name, ref in self._submitted)
            running, failed = boundary.failed_now(list(names))
            keep = set(running)
            self._submitted = deque((n, r) for n, r in self._submitted if r in keep)
        for ref, exc in failed:
            self.record(names[ref], boundary.translate(exc, "submitting commands", self._died))

    # ---- queueing -------------------------------------------------------------------
    def enqueue(self, name: str, cmd: Command) -> None:
        if self._error is not None or self.lost:
            self.check(name)
        with self._lock:
            if self._grouped:
                # A slice and a multislice group that shares its chips feed the same
                # workers: what was issued to one goes out before what follows on the other.
                mine = self._members[name]
                for other, members in self._members.items():
                    if other != name and members & mine and self._pending[other]:
                        self.flush_one(other)
            pending = self._pending[name]
            pending.append(cmd)
            if len(pending) >= self.max_batch:
                self.flush_one(name)
            elif len(pending) == 1:
                if time.monotonic() - self._last_flush[name] > self._flush_interval_s:
                    # The start of a burst after a pause: the slice may be idle, so the
                    # first command goes now and the rest are batched behind it.
                    self.flush_one(name)
                self._wake.set()  # the background thread also learns how the submit went

    def free(self, name: str, buffer_id: int) -> None:
        if self._closed:
            return
        with self._lock:
            frees = self._frees.get(name)
            if frees is None:
                return
            frees.append(buffer_id)
            if len(frees) == 1 and not self._pending[name]:
                self._wake.set()

    def flush_one(self, name: str) -> None:
        with self._lock:
            batch = self._pending[name]
            if self._frees[name]:
                batch.append(Free(tuple(self._frees[name])))
                self._frees[name] = []
            if not batch or any(m in self.lost for m in self._members[name]):
                batch.clear()
                return
            self._pending[name] = []
            t0 = time.time_ns()
            self._submitted.append((name, self._controller.submit.remote(name, batch)))
            if self.spans is not None:
                self.spans.append(Event("dispatch", f"send {name}", t0, time.time_ns() - t0,
                                        {"commands": len(batch)}))
            while len(self._submitted) > MAX_SUBMITTED:  # bound what waits at the controller
                oldest, ref = self._submitted.popleft()
                try:
                    boundary.get(ref, timeout="stream", what="a batch of commands",
                                 died=self._died)
                except PathwaysError as e:
                    self.record(oldest, e)
            # From when the send (and any wait for room) ended: a sender held up here is
            # ahead of the slice, so what it issues next is no burst after a pause (sent
            # alone, every other batch would be one command).
            self._last_flush[name] = time.monotonic()

    def flush(self) -> None:
        for name in list(self._pending):
            self.flush_one(name)

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            time.sleep(self._flush_interval_s)  # let a steady stream fill the batch
            try:
                self.flush()
                self.poll()
            except Exception as e:  # noqa: BLE001 - kept for the next call
                logger.debug("background flush failed", exc_info=True)
                with self._lock:
                    self._error = self._error or e

    def close(self) -> None:
        self._closed = True
        self._wake.set()
