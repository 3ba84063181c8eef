"""``client.profile()``: one trace of a client's work across every chip it drives.

While a profile runs, every chip worker records JAX's profiler (XLA's own events
plus a span per command it runs), the controller records a span per batch it
dispatches, and the client a span per program call and per batch it sends. On
exit everything is merged on the controller's clock (``profile_trace.py``) and
written under ``log_dir/plugins/profile/<run>/``: ``pathways.perfetto.json.gz`` for
ui.perfetto.dev, and ``pathways.xplane.pb`` for ``tensorboard --logdir`` / XProf.

``pathways-ray profile -- python train.py`` profiles a whole job: it sets
``$PATHWAYS_RAY_PROFILE_DIR``, and every client the job connects records from
``connect()`` to ``close()``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pathways_ray.config import base_dir
from pathways_ray.observability import profile_trace

logger = logging.getLogger(__name__)

__all__ = ["PROFILE_ENV", "Profile"]

PROFILE_ENV = "PATHWAYS_RAY_PROFILE_DIR"


class Profile:
    """A profile of one client; a context manager (``with client.profile() as prof``).
    After it ends, ``paths`` names the files written and ``tracks`` holds the merged
    timelines."""

    def __init__(self, client, log_dir: str | os.PathLike | None = None):
        self._client = client
        self.log_dir = Path(log_dir) if log_dir else base_dir() / "profiles"
        self.run = time.strftime("%Y_%m_%d_%H_%M_%S") + f"_{os.getpid()}"
        self.paths: dict[str, str] | None = None
        self.tracks: list[profile_trace.Track] = []
        self.clocks: dict[str, tuple[int, int]] = {}  # chip -> (clock offset, +-), ns
        self._spans: list[profile_trace.Event] | None = None

    def start(self) -> Profile:
        c = self._client
        c._queue.flush()
        c._call("profile_start")
        self._spans = []
        c._spans = c._queue.spans = self._spans
        return self

    def stop(self) -> dict[str, str]:
        """Wait until everything sent has run, stop every profiler, merge and write."""
        c = self._client
        try:
            c._queue.flush()
            c._call("drain", timeout="stream")
        finally:
            got = c._call("profile_stop", timeout="fetch")
            spans, self._spans = self._spans or [], None
            c._spans = c._queue.spans = None
        self.tracks = profile_trace.fleet_tracks(spans, got)
        self.clocks = {f"{c['slice']} chip {c['rank']}": (c["offset_ns"], c["uncertainty_ns"])
                       for c in got["chips"]}
        self.paths = profile_trace.write(self.tracks, self.log_dir, self.run)
        chips = len(self.tracks) - 2
        events = sum(len(t.events) for t in self.tracks)
        logger.info("profile of %d chips (%d events) written: %s (ui.perfetto.dev) and "
                    "%s (tensorboard --logdir %s)", chips, events, self.paths["perfetto"],
                    self.paths["xplane"], self.log_dir)
        return self.paths

    def __enter__(self) -> Profile:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
