"""Clients made before the sessions that take them (Cloud Pathways' workers are up
before a user connects; here a session would otherwise reserve its slices and start
a chip worker per chip in its ``InitRequest``: 9-10 s on this machine).

``WarmClients`` makes one client (``connect``: a controller, its slices, their chip
workers) when the server starts. A session takes it (``take``), or, when none is
ready, connects its own as before. When a session ends its client comes back
(``give_back``): emptied (every array of the session freed on the chips, checked by
counting the chips' buffers) and healthy (no slice lost), it waits for the next
session; otherwise it is closed. One is kept at most: a warm client holds slices
that another user of the fleet may be waiting for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["WarmClients", "is_clean"]


def is_clean(stats: dict[str, Any]) -> bool:
    """Whether a client's ``stats()`` show nothing left of a session: no array the
    controller tracks, no buffer on any chip."""
    return bool(stats) and all(
        s.get("live_arrays", 1) == 0 and all(w.get("buffers", 1) == 0 for w in s["workers"])
        for s in stats.values())


class WarmClients:
    """At most one ready client for the next session (see the module)."""

    def __init__(self, connect: Callable[..., Any], *, enabled: bool = True,
                 wait_s: float = 120.0, reserve_s: float = 30.0):
        self._connect = connect
        # Made in the background, a client gives up on slices that stay busy soon: a
        # session waiting for the same slices must not lose them to it.
        self._reserve_s = reserve_s
        self.enabled = enabled
        self._wait_s = wait_s  # how long a session waits for the one being made
        self._cond = threading.Condition()
        self._ready: Any = None
        self._making: threading.Thread | None = None
        self._cold = 0  # sessions connecting clients of their own now
        self._closed = False
        self.counts = {"made": 0, "taken_warm": 0, "connected_cold": 0, "kept": 0,
                       "closed": 0}

    def start(self) -> None:
        """Make the first client in the background."""
        if self.enabled:
            with self._cond:
                self._make_locked()

    def _make_locked(self) -> None:
        if (self._closed or self._ready is not None or self._making is not None
                or self._cold):
            return
        self._making = threading.Thread(target=self._make, daemon=True,
                                        name="pathways-ray-proxy-warm")
        self._making.start()

    def _make(self) -> None:
        t0 = time.monotonic()
        client = None
        try:
            client = self._connect(reserve_timeout_s=self._reserve_s)
        except Exception as e:  # noqa: BLE001 - a session will connect its own and say why
            logger.info("no warm client for the next session: %s", e)
        with self._cond:
            self._making = None
            if client is not None and not self._closed:
                self._ready, client = client, None
                self.counts["made"] += 1
                logger.info("a warm client is ready for the next session (%.1f s)",
                            time.monotonic() - t0)
            self._cond.notify_all()
        if client is not None:  # closed meanwhile
            _close(client)

    def take(self) -> Any:
        """The ready client (if all its slices are still there), or the one being made
        (waited for up to ``wait_s``), else a new one connected now."""
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            while (self._ready is None and self._making is not None and not self._closed
                   and time.monotonic() < deadline):
                self._cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            client, self._ready = self._ready, None
        if client is not None:
            if _usable(client):
                self.counts["taken_warm"] += 1
                return client
            logger.info("the warm client lost a slice while it waited: closed")
            self.counts["closed"] += 1
            _close(client)
        with self._cond:
            self.counts["connected_cold"] += 1
            self._cold += 1  # no client is made in the background meanwhile: no race
        try:
            return self._connect()
        finally:
            with self._cond:
                self._cold -= 1

    def give_back(self, client: Any, *, healthy: bool = True) -> None:
        """A session's client, its arrays dropped: kept for the next session if it
        is emptied and healthy and none is kept yet; closed otherwise."""
        keep = self.enabled and healthy and not self._closed
        if keep:
            try:
                keep = _usable(client) and is_clean(client.stats())
                if not keep:
                    logger.info("a session's client lost a slice or still holds buffers: "
                                "closed, not reused")
            except Exception as e:  # noqa: BLE001 - a broken client is closed, not kept
                logger.info("a session's client is not reused: %s", e)
                keep = False
        with self._cond:
            if keep and self._ready is None and not self._closed:
                self._ready, client = client, None
                self.counts["kept"] += 1
                self._cond.notify_all()
        if client is not None:
            self.counts["closed"] += 1
            _close(client)
            with self._cond:  # its slices are free again: make the next one ahead
                if self.enabled:
                    self._make_locked()

    def close(self, timeout_s: float = 60.0) -> None:
        """Close the ready client and the one being made (waited for)."""
        with self._cond:
            self._closed = True
            client, self._ready = self._ready, None
            making = self._making
            self._cond.notify_all()
        if client is not None:
            _close(client)
        if making is not None:
            making.join(timeout_s)  # _make closes what it made once it sees closed


def _usable(client: Any) -> bool:
    """Its controller answers, with every slice it started with."""
    try:
        live = {d["name"] for d in client.describe()}
    except Exception:  # noqa: BLE001 - a controller that does not answer is not used
        return False
    return live == {s.name for s in client.slices}


def _close(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing the others must go on
        logger.warning("closing a client failed", exc_info=True)
