"""A client's side of a lease: waiting in a service's queue, then keeping the lease
alive with heartbeats until it is released."""

from __future__ import annotations

import getpass
import logging
import os
import socket
import threading
import time

from pathways_ray import boundary
from pathways_ray.config import USER_ENV, timeout_s
from pathways_ray.errors import LeaseRevoked, PathwaysError, ReservationTimeout
from pathways_ray.service.control import _gone, get_service
from pathways_ray.service.lease import parse_request

__all__ = ["Heartbeat", "lease", "owner"]

logger = logging.getLogger(__name__)


def owner() -> dict:
    """Who asks: shown in the service's status (``$PATHWAYS_RAY_USER``, else the login)."""
    return {"user": os.environ.get(USER_ENV) or getpass.getuser(),
            "host": socket.gethostname(), "pid": os.getpid()}


def lease(name: str, slices, *, timeout: float | None = None) -> dict:
    """Wait in service ``name``'s queue for ``slices``; returns the grant. Logs the
    queue position as it changes; gives up after ``timeout`` seconds (default
    ``$PATHWAYS_RAY_LEASE_TIMEOUT_S``), leaving the queue."""
    wants = parse_request(slices)
    svc = get_service(name)
    limit, setting = (timeout, "lease_timeout_s=") if timeout else (
        timeout_s("lease"), "lease_timeout_s= or $PATHWAYS_RAY_LEASE_TIMEOUT_S")
    if limit <= 0:
        raise ValueError(f"lease_timeout_s={timeout!r} must be positive")
    died = _gone(name)
    t0 = time.monotonic()
    ticket = boundary.get(svc.request.remote(owner(), list(wants)), timeout="control",
                          what=f"asking service {name!r} for slices", died=died)
    rid, shown = ticket["request"], None
    try:
        while True:
            left = limit - (time.monotonic() - t0)
            if left <= 0:
                raise ReservationTimeout(
                    f"service {name!r} granted no lease of {_wants(wants)} within {limit:g} s "
                    f"({setting}); position {shown} in its queue. See who holds its slices "
                    f"with `pathways-ray service status --name {name}`")
            got = boundary.get(svc.wait.remote(rid, min(2.0, left)), timeout="control",
                               what=f"waiting for service {name!r}", died=died)
            if got["state"] == "granted":
                return got["lease"]
            if got["state"] == "failed":
                raise LeaseRevoked(f"service {name!r}: {got['why']}")
            if got["position"] != shown:
                shown = got["position"]
                logger.warning("waiting for %s from service %r: position %s of %s in its "
                               "queue (%.0f s so far)", _wants(wants), name, shown,
                               got["queue"], time.monotonic() - t0)
    except BaseException:
        # Wait (briefly) for the service to take the request off its queue, so that who
        # gave up has left it by the time the error reaches them.
        try:
            boundary.get(svc.cancel.remote(rid), timeout=5.0,
                         what=f"leaving service {name!r}'s queue", died=died)
        except Exception:  # noqa: BLE001 - the service is gone or slow: it drops the
            pass           # request anyway once its polls stop (heartbeat_s)
        raise


def _wants(wants) -> str:
    return ", ".join(f"{n} x {k}" for k, n in wants)


class Heartbeat:
    """A client's heartbeat to its service: a daemon thread beating every fifth of the
    service's timeout. ``revoked`` holds the error once the lease is gone."""

    def __init__(self, grant: dict):
        self._svc = get_service(grant["service"])
        self.lease_id, self._token = grant["lease"], grant["token"]
        self.name = grant["service"]
        self._timeout = grant["heartbeat_timeout_s"]
        self.revoked: LeaseRevoked | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="pathways-ray-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        import ray

        last_ok = time.monotonic()
        period = max(0.2, min(5.0, self._timeout / 5))
        while not self._stop.wait(period):
            try:
                alive = ray.get(self._svc.heartbeat.remote(self.lease_id, self._token),
                                timeout=period * 2)
            except Exception as e:  # noqa: BLE001 - the service slow or gone
                if time.monotonic() - last_ok > self._timeout:
                    self.revoked = LeaseRevoked(
                        f"{self.lease_id} of service {self.name!r} ended: the service did not "
                        f"answer for {self._timeout:g} s ({type(e).__name__}); connect again")
                    return
                continue
            if not alive:
                self.revoked = LeaseRevoked(
                    f"{self.lease_id} of service {self.name!r} was taken back: its heartbeats "
                    f"stopped for over {self._timeout:g} s ($PATHWAYS_RAY_HEARTBEAT_TIMEOUT_S "
                    f"of the service) or its controller died; its slices went to the pool. "
                    f"Connect again")
                return
            last_ok = time.monotonic()

    def check_now(self) -> LeaseRevoked | None:
        """Ask the service once (after the controller died: was the lease taken back?)."""
        if self.revoked is None:
            try:
                if not boundary.get(self._svc.heartbeat.remote(self.lease_id, self._token),
                                    timeout="control", what="a heartbeat",
                                    died=_gone(self.name)):
                    self._stop.set()
                    self._thread.join(1.0)
                    self.revoked = self.revoked or LeaseRevoked(
                        f"{self.lease_id} of service {self.name!r} was taken back (no "
                        f"heartbeat for {self._timeout:g} s); connect again")
            except PathwaysError as e:
                self.revoked = LeaseRevoked(str(e))
        return self.revoked

    def release(self) -> None:
        """Stop beating and give the slices back (once; nothing if already revoked)."""
        self._stop.set()
        if self.revoked is None:
            try:
                boundary.get(self._svc.release.remote(self.lease_id, self._token),
                             timeout="control", what=f"releasing {self.lease_id}",
                             died=_gone(self.name))
            except PathwaysError as e:
                logger.info("releasing %s: %s", self.lease_id, e)
            self.revoked = LeaseRevoked(f"{self.lease_id} was released (the client closed)")

    def attach(self, controller) -> None:
        boundary.get(self._svc.attach.remote(self.lease_id, self._token, controller),
                     timeout="control", what=f"attaching {self.lease_id}", died=_gone(self.name))
