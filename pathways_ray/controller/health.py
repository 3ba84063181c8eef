"""Slice health, watched from the controller: a dead host within a second, a frozen
one within the step deadline.

A killed chip worker (its process, or its whole host) closes its end of the
command stream: the kernel sends FIN or RST, and the controller's socket
leaves the ESTABLISHED state at once. A *frozen* one (SIGSTOP, a hung VM)
keeps its socket open and falls silent; its peers would hang in gloo until
JAX's heartbeat timeout (~100 s). A worker running a batch repeats its count
every ``channel.HEARTBEAT_S``, so silence tells frozen from busy: a worker with
batches outstanding that sends nothing for ``step_timeout_s`` is frozen, and
its slice is condemned. A worker that keeps talking but makes no progress
(a step that hangs, though its process runs) gets ``compile_timeout_s``, or
``SLOW_FACTOR`` times its slowest batch if longer. Workers waiting on a frozen
peer, in their slice or another, keep talking: the blame lands on the frozen one.

``stall_verdict`` is the decision, pure and tested in milliseconds;
``HealthMonitor`` is the thread that feeds it and acts on it. The monitor
reads sockets without consuming from them (the controller's own thread
reads the acks), so it needs no lock with the dispatch path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["HealthMonitor", "Regrower", "StreamState", "stall_verdict"]

logger = logging.getLogger(__name__)


SLOW_FACTOR = 5.0  # a batch may take this many times the slowest one seen so far


def stall_verdict(sent: int, progress: int, stalled_for_s: float, silent_for_s: float,
                  step_timeout_s: float, compile_timeout_s: float,
                  slowest_batch_s: float = 0.0) -> str | None:
    """Why a chip worker counts as frozen or hung, or None while it is fine.

    ``sent`` batches went to it and it acknowledged ``progress`` of them; its count
    last moved ``stalled_for_s`` ago and it last sent anything (an ack or a
    heartbeat) ``silent_for_s`` ago. Silence past ``step_timeout_s`` with work
    outstanding is a frozen worker. Talking without progress past the hang limit
    (``compile_timeout_s``, or ``SLOW_FACTOR`` times the slowest batch so far if
    longer) is a step that hangs.
    """
    if progress >= sent:
        return None  # idle: nothing outstanding
    outstanding = sent - progress
    if silent_for_s > step_timeout_s:
        return (f"silent for {silent_for_s:.0f} s with {outstanding} batch(es) outstanding "
                f"(limit {step_timeout_s:g} s, $PATHWAYS_RAY_STEP_TIMEOUT_S): its host is "
                f"frozen")
    limit = max(compile_timeout_s, SLOW_FACTOR * slowest_batch_s)
    if stalled_for_s <= limit:
        return None
    return (f"no progress for {stalled_for_s:.0f} s on a batch though alive ({outstanding} "
            f"outstanding; limit {limit:g} s, $PATHWAYS_RAY_COMPILE_TIMEOUT_S): a step hangs")


@dataclass
class StreamState:
    """What the monitor remembers of one command stream between looks."""

    progress: int = 0
    since: float = field(default_factory=time.monotonic)
    frames: int = 0  # acks and heartbeats heard
    heard: float = field(default_factory=time.monotonic)
    slowest_batch_s: float = 0.0  # the longest a batch without a program load took


class HealthMonitor:
    """Looks at every command stream of every live slice each ``interval_s``.

    ``streams()`` yields ``(slice name, channel, number of the last batch that holds a
    Load)``;
    ``condemn(slice name, reason)`` is called once per slice found dead or frozen;
    ``also()`` may add verdicts of its own (``{slice name: reason}``).
    """

    def __init__(self, streams: Callable[[], Iterable[tuple[str, object, int]]],
                 condemn: Callable[[str, str], None], *, interval_s: float = 0.25,
                 step_timeout_s: float, compile_timeout_s: float,
                 also: Callable[[], dict[str, str]] | None = None):
        self._streams = streams
        self._condemn = condemn
        self._also = also  # more verdicts {slice: reason} (the controller's sidecar pings)
        self.interval_s = interval_s
        self.step_timeout_s = step_timeout_s
        self.compile_timeout_s = compile_timeout_s
        self._state: dict[int, StreamState] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="pathways-ray-health")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.look()
            except Exception:  # noqa: BLE001 - a bad look must not end the watch
                logger.exception("health check failed")

    def look(self) -> None:
        now = time.monotonic()
        condemned: dict[str, str] = {}
        seen = set()
        for name, ch, last_load in self._streams():
            if name in condemned:
                continue
            seen.add(id(ch))
            closed, progress, frames = ch.probe()
            if closed:
                condemned[name] = getattr(ch, "blame", None) or (
                    f"the command stream to {ch.what} closed: its process or host died")
                continue
            st = self._state.setdefault(id(ch), StreamState(progress, now, frames, now))
            if progress != st.progress:
                if last_load <= st.progress:  # none of the batches just done compiled
                    per_batch = (now - st.since) / (progress - st.progress)
                    st.slowest_batch_s = max(st.slowest_batch_s, per_batch)
                st.progress, st.since = progress, now
            elif progress >= ch.sent:
                st.since = now  # idle
            if frames != st.frames or progress >= ch.sent:
                st.frames, st.heard = frames, now  # heard from, or nothing to say
            verdict = stall_verdict(ch.sent, progress, now - st.since, now - st.heard,
                                    self.step_timeout_s, self.compile_timeout_s,
                                    st.slowest_batch_s)
            if verdict:
                condemned[name] = f"{ch.what}: {verdict}"
        for key in set(self._state) - seen:
            del self._state[key]
        if self._also is not None:
            for name, reason in self._also().items():
                condemned.setdefault(name, reason)
        for name, reason in condemned.items():
            self._condemn(name, reason)

    def stop(self) -> None:
        self._stop.set()


class Regrower:
    """Reserves replacement slices in the background, one after another, as soon as the
    cluster has a free slice of the wanted shape (it looks once a second).

    ``reserve(topology)`` does the reserving (and raises if someone else took the
    slice meanwhile: tried again); ``add(result)`` hands the new slice over.
    """

    def __init__(self, reserve: Callable, add: Callable, interval_s: float = 1.0):
        self._reserve, self._add = reserve, add
        self.interval_s = interval_s
        self._wanted: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def want(self, shapes: list) -> None:
        """The replacements to have on their way now (replaces the earlier wish)."""
        with self._lock:
            self._wanted = list(shapes)
            if self._wanted and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="pathways-ray-regrow")
                self._thread.start()

    def _next(self):
        with self._lock:
            return self._wanted[0] if self._wanted else None

    def _run(self) -> None:
        from pathways_ray.clusters.cluster import cluster_slices

        while not self._stop.is_set() and (topo := self._next()) is not None:
            if not any(v.idle and v.topology == topo for v in cluster_slices()):
                self._stop.wait(self.interval_s)  # no capacity yet
                continue
            try:
                got = self._reserve(topo)
            except Exception:  # noqa: BLE001 - taken meanwhile, or it died: try again
                logger.warning("reserving a replacement %s failed; retrying", topo,
                               exc_info=True)
                self._stop.wait(self.interval_s)
                continue
            if self._stop.is_set():
                got[0].shutdown()
                return
            self._add(got)
            with self._lock:
                if self._wanted and self._wanted[0] == topo:
                    self._wanted.pop(0)

    def stop(self, wait_s: float = 0.0) -> bool:
        """Stop; with ``wait_s``, wait that long for a reservation in flight to be
        released. Returns whether the thread is done."""
        self._stop.set()
        thread = self._thread
        if thread is not None and wait_s > 0:
            thread.join(wait_s)
        return thread is None or not thread.is_alive()
