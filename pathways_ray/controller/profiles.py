"""``client.profile()`` on the controller: start and stop every chip's profiler and
measure each host's clock against this one."""

from __future__ import annotations

import time

from pathways_ray import boundary


class Profiles:
    """Mixin of ``Controller``: ``profile_start`` and ``profile_stop``."""

    def _live_workers(self) -> list:
        with self._lock:
            return [(s, w) for s in self.slices.values() for w in s.workers]

    def profile_start(self) -> None:
        """Start JAX's profiler on every chip of every live slice, and record this
        controller's dispatch spans."""
        workers = self._live_workers()
        boundary.get([w.handle.profile.remote("start", lease=self._token) for _, w in workers],
                     timeout="control", what="starting the profiler on every chip")
        self._spans = []

    def profile_stop(self) -> dict:
        """Stop the profilers; returns the dispatch spans and, per chip, its events with
        its clock's measured offset from this one (``profile_trace.clock_offset``)."""
        from pathways_ray.observability.profile_trace import clock_offset

        spans, self._spans = self._spans or [], None
        workers = self._live_workers()
        events = boundary.get([w.handle.profile.remote("stop", lease=self._token)
                               for _, w in workers],
                              timeout="fetch", what="the chips' profiles")
        # One clock per host (its chips share it): a few round trips each, one at a time;
        # the one with the least queueing is the best estimate.
        offsets: dict[str, tuple[int, int]] = {}
        for _, w in workers:
            if w.info.node_id in offsets:
                continue
            samples = []
            for _ in range(3):
                sent = time.time_ns()
                remote = boundary.get(w.handle.clock.remote(), timeout="control",
                                      what="a chip's clock")
                samples.append((sent, remote, time.time_ns()))
            offsets[w.info.node_id] = clock_offset(samples)
        chips = []
        for (s, w), evs in zip(workers, events, strict=True):
            offset, error = offsets[w.info.node_id]
            chips.append({"slice": s.name, "rank": w.rank, "host": w.info.worker_id,
                          "events": evs, "offset_ns": offset, "uncertainty_ns": error})
        return {"controller": spans, "chips": chips}

