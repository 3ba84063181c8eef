"""A shared, long-running service that clients lease slices from.

``pathways-ray service start --name team`` starts ``Service``, a detached Ray
actor that reserves a pool of slices once and keeps their chip workers running.
``pathways_ray.connect(service="team", slices={"v6e-2x2": 1})`` asks it for
slices; the client waits in the queue if they are busy, then gets a lease: the
slices' chips, lent to a controller of its own (started beside the client, as a
private ``connect()`` starts one), and a token. The service never sees a step:
it grants, watches and takes back, so one client's long fetch cannot stall
another's, and a lease costs no more per step than a private controller.

Isolation: a lease's token is presented on every call that reaches its chips
(``ChipWorker.bind`` lends a chip to one token; the chip refuses the rest) and
buffer ids are per client. When a lease ends (the client closes, its process
dies and takes its controller with it, or its heartbeats stop for
``$PATHWAYS_RAY_HEARTBEAT_TIMEOUT_S``), the service kills its controller,
rebinds its chips to the pool (dropping every buffer and program it left) and
grants the next request. A slice that fails is shut down and a replacement is
reserved in the background; capacity never leaks (``lease.LeaseBook``).

Numbers (active users, leases, capacity in use, queue length, time waited)
go out as Ray metrics, in Prometheus format from every node's metrics agent.

This module is the actor. ``control`` starts, finds and stops services (the
CLI's calls); ``leasing`` is a client's side of a lease (the queue, heartbeats).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from pathways_ray import boundary
from pathways_ray.clusters.topology import Topology
from pathways_ray.config import timeout_s
from pathways_ray.errors import LeaseRevoked, PathwaysError, ReservationTimeout, WaitTimeout
from pathways_ray.service.lease import LeaseBook

__all__ = ["Service"]

logger = logging.getLogger(__name__)

_ACTOR_PREFIX = "service-"
_MONITOR_S = 0.5


def _actor_name(name: str) -> str:
    return _ACTOR_PREFIX + name


class Service:
    """The pool, the book and the monitor. Create it with ``start_service``."""

    def __init__(self, name: str, slices: list | None, reserve_timeout_s: float | None = None,
                 compilation_cache_dir: str | None = None):
        self.name = name
        self._specs = slices
        self._opts = dict(timeout_s=reserve_timeout_s,
                          compilation_cache_dir=compilation_cache_dir)
        self._book = LeaseBook()
        self._cond = threading.Condition()  # guards the book; wakes waiters
        self._slices: dict = {}  # name -> Slice (the service holds the reservations)
        self._pool_token = "pool-" + secrets.token_hex(16)  # chips not lent are bound to it
        self._handed: dict[str, dict | str] = {}  # request -> its grant, or why it failed
        self._granting: set[str] = set()  # requests granted whose chips are being lent
        self._cancelled: set[str] = set()  # ... whose client gave up meanwhile
        self._pings: dict[str, object] = {}  # lease -> outstanding ping of its controller
        self._stopping = threading.Event()
        self._replacing: list = []  # placement groups of replacements being reserved
        self._heartbeat_s = timeout_s("heartbeat")
        self._metrics = None
        self._monitor: threading.Thread | None = None

    # ---- life -------------------------------------------------------------------------
    def start(self) -> dict:
        """Reserve the pool (every free slice of the cluster if none were named) and
        start watching; returns ``status()``."""
        from pathways_ray.clusters.cluster import cluster_slices
        from pathways_ray.controller.placement import reserve_all

        specs = self._specs
        if specs is None:
            specs = [v.topology for v in cluster_slices() if v.idle and v.topology is not None]
            if not specs:
                raise ReservationTimeout("no free TPU slice in the cluster for the service's "
                                         "pool; free one, or add TPU hosts")
        reserved = reserve_all([Topology.of(s) for s in specs], self._opts)
        try:
            for s in reserved:
                self._bind(s, self._pool_token)
        except BaseException:
            for s in reserved:
                s.shutdown()
            raise
        with self._cond:
            for s in reserved:
                self._slices[s.name] = s
                self._book.add_slice(s.name, s.topology)
        self._metrics = _Metrics(self.name)
        self._monitor = threading.Thread(target=self._watch, daemon=True,
                                         name="pathways-ray-service-monitor")
        self._monitor.start()
        logger.warning("service %s: %d slices in the pool", self.name, len(reserved))
        return self.status()

    def stop(self) -> dict:
        """End every lease, release every slice; returns what was released."""
        import ray

        self._stopping.set()
        with self._cond:
            leases = [self._book.end(lid) for lid in list(self._book.leases)]
            waiting = [r.id for r in self._book.queue]
            for rid in waiting:
                self._book.cancel(rid)
                self._handed[rid] = f"the service {self.name!r} stopped"
            slices, self._slices = dict(self._slices), {}
            self._cond.notify_all()
        for ls in leases:
            if ls is not None and ls.controller is not None:
                ray.kill(ls.controller)
        for spg in list(self._replacing):
            try:
                spg.shutdown()
            except Exception:  # noqa: BLE001 - released already
                pass
        late = boundary.settle([w.handle.shutdown_world.remote() for s in slices.values()
                                for w in s.workers], timeout_s("shutdown") / 2)
        if late:
            logger.info("service %s: %d chip workers did not leave their world", self.name, late)
        for s in slices.values():
            s.shutdown(lost=True)  # worlds are left: kill and release
        return {"slices": sorted(slices), "leases": [ls.id for ls in leases if ls],
                "requests": waiting}

    def ping(self) -> str:
        return self.name

    # ---- requests -------------------------------------------------------------------
    def request(self, owner: dict, wants: list) -> dict:
        """Queue a request (granted at once when it fits); ``{"request", "position"}``."""
        self._check_running()
        with self._cond:
            req = self._book.request(owner, tuple((str(k), int(n)) for k, n in wants),
                                     time.monotonic())
            self._schedule_locked()
            return {"request": req.id, "position": self._book.position(req.id),
                    "queue": len(self._book.queue)}

    def wait(self, request_id: str, wait_s: float = 2.0) -> dict:
        """Up to ``wait_s`` for the request's grant: ``{"state": "granted", "lease"}``,
        ``{"state": "queued", "position", "queue"}``, or ``{"state": "failed", "why"}``.
        A request nobody waits on for the heartbeat timeout leaves the queue."""
        deadline = time.monotonic() + min(max(wait_s, 0.0), 10.0)
        with self._cond:
            while True:
                now = time.monotonic()
                self._book.touch(request_id, now)
                got = self._handed.get(request_id)
                if isinstance(got, dict):
                    del self._handed[request_id]
                    return {"state": "granted", "lease": got}
                if isinstance(got, str):
                    del self._handed[request_id]
                    return {"state": "failed", "why": got}
                pos = self._book.position(request_id)
                if pos is None and request_id not in self._granting:
                    return {"state": "failed", "why": f"request {request_id} is not in the "
                            f"queue (cancelled, or not polled for {self._heartbeat_s:g} s)"}
                if now >= deadline:
                    return {"state": "queued", "position": pos, "queue": len(self._book.queue)}
                self._cond.wait(deadline - now)

    def cancel(self, request_id: str) -> None:
        """The client gives up: leave the queue, or give back a grant it never took."""
        with self._cond:
            self._book.cancel(request_id)
            if request_id in self._granting:
                self._cancelled.add(request_id)
            got = self._handed.pop(request_id, None)
            self._schedule_locked()
        if isinstance(got, dict):
            self.release(got["lease"], got["token"])

    # ---- leases ---------------------------------------------------------------------
    def attach(self, lease_id: str, token: str, controller) -> None:
        """The lease's controller (watched: when it dies, the lease ends)."""
        with self._cond:
            try:
                self._book.check(lease_id, token).controller = controller
            except KeyError:  # taken back before its controller started
                raise LeaseRevoked(f"{lease_id} of service {self.name!r} ended before its "
                                   f"controller started (no heartbeat for "
                                   f"{self._heartbeat_s:g} s); connect again") from None

    def heartbeat(self, lease_id: str, token: str) -> bool:
        """False once the lease has ended (the client must stop using it)."""
        with self._cond:
            return self._book.beat(lease_id, token, time.monotonic())

    def release(self, lease_id: str, token: str) -> None:
        """The client is done: clean its slices and give them to the next request."""
        with self._cond:
            try:
                self._book.check(lease_id, token)
            except KeyError:
                return  # ended already (reclaimed)
            lease = self._book.end(lease_id)
        self._take_back(lease, "released")

    def status(self) -> dict:
        with self._cond:
            snap = self._book.snapshot(time.monotonic())
        return {"name": self.name, "heartbeat_timeout_s": self._heartbeat_s, **snap}

    # ---- inside -----------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._stopping.is_set():
            raise LeaseRevoked(f"the service {self.name!r} is stopping")

    def _schedule_locked(self) -> None:
        """Grant what fits; each grant's chips are lent in a thread of its own."""
        if self._stopping.is_set():
            return
        for req, lease in self._book.schedule(time.monotonic()):
            self._granting.add(req.id)
            threading.Thread(target=self._hand_over, args=(req, lease), daemon=True,
                             name=f"pathways-ray-grant-{lease.id}").start()

    def _hand_over(self, req, lease) -> None:
        """Lend the chips of a granted lease to its token, then give the grant to the
        waiting client. A slice that fails to take the token is broken: it is replaced,
        the lease is undone and the request goes back to the head of the queue."""
        broken = []
        for name in lease.slices:
            try:
                self._bind(self._slices[name], lease.token)
            except PathwaysError as e:
                logger.warning("service %s: slice %s failed while being lent (%s)", self.name,
                               name, e)
                broken.append(name)
        with self._cond:
            self._granting.discard(req.id)
            gave_up = req.id in self._cancelled
            self._cancelled.discard(req.id)
            if broken or gave_up or self._stopping.is_set():
                self._book.end(lease.id)
                if not (gave_up or self._stopping.is_set()):
                    self._book.queue.insert(0, req)
            else:
                self._handed[req.id] = {
                    "lease": lease.id, "token": lease.token, "service": self.name,
                    "heartbeat_timeout_s": self._heartbeat_s, "waited_s": lease.waited_s,
                    "slices": [self._slices[n].lend() for n in lease.slices]}
                self._metrics.waited(lease.waited_s)
            self._cond.notify_all()
        if broken or gave_up or self._stopping.is_set():
            self._take_back(lease, "broken while lent" if broken else "not taken",
                            broken=set(broken))

    def _bind(self, s, token: str) -> None:
        boundary.get([w.handle.bind.remote(token) for w in s.workers],
                     timeout=min(10.0, timeout_s("control")),
                     what=f"lending the chips of slice {s.name}")

    def _take_back(self, lease, why: str, broken: set[str] = frozenset()) -> None:
        """A lease ended: stop its controller, clean its slices (``bind`` to the pool:
        drops what it left) or replace the ones that failed; then grant what waits."""
        import ray

        if lease.controller is not None:
            try:
                ray.kill(lease.controller)
            except Exception:  # noqa: BLE001 - gone already
                pass
        self._pings.pop(lease.id, None)
        for name in lease.slices:
            s = self._slices.get(name)
            healthy = s is not None and name not in broken
            if healthy:
                try:
                    self._bind(s, self._pool_token)
                except PathwaysError as e:
                    logger.warning("service %s: slice %s failed as %s returned it (%s)",
                                   self.name, name, lease.id, e)
                    healthy = False
            with self._cond:
                if name in self._book.slices():
                    self._book.returned(name, healthy)
            if not healthy and s is not None:
                self._replace(name)
        logger.info("service %s: %s ended (%s)", self.name, lease.id, why)
        with self._cond:
            self._schedule_locked()
            self._cond.notify_all()

    def _replace(self, name: str) -> None:
        """Release a broken slice and reserve one of its shape in the background,
        trying until the cluster has one free (or the service stops)."""
        s = self._slices[name]
        try:
            s.shutdown(lost=True)
        except Exception:  # noqa: BLE001 - its host is gone; release what is left
            logger.info("releasing broken slice %s", name, exc_info=True)
        threading.Thread(target=self._reserve_replacement, args=(name, s.topology),
                         daemon=True, name=f"pathways-ray-replace-{name}").start()

    def _reserve_replacement(self, old: str, topo: Topology) -> None:
        from pathways_ray.chips.slice import Slice

        while not self._stopping.is_set():
            try:
                s = Slice.reserve(topo, track=self._replacing, **self._opts)
            except (ReservationTimeout, WaitTimeout, PathwaysError) as e:
                logger.info("service %s: no replacement for %s yet (%s)", self.name, old, e)
                time.sleep(1.0)
                continue
            try:
                self._bind(s, self._pool_token)
            except PathwaysError:
                s.shutdown(lost=True)
                continue
            with self._cond:
                if self._stopping.is_set():
                    break
                self._slices.pop(old, None)
                self._slices[s.name] = s
                self._book.replace_slice(old, s.name, s.topology)
                self._schedule_locked()
                self._cond.notify_all()
            logger.warning("service %s: slice %s replaces %s", self.name, s.name, old)
            return
        if "s" in locals():
            s.shutdown()

    def _watch(self) -> None:
        """End leases whose holder went silent or whose controller died; drop requests
        nobody polls; export the numbers."""
        import ray

        while not self._stopping.wait(_MONITOR_S):
            now = time.monotonic()
            ended = []
            with self._cond:
                silent, dropped = self._book.expired(now, self._heartbeat_s)
                for rid in dropped:
                    if rid not in self._granting:
                        self._book.cancel(rid)
                for lid in silent:
                    ended.append((self._book.end(lid, reclaimed=True),
                                  f"no heartbeat for {self._heartbeat_s:g} s"))
                watched = [(ls.id, ls.controller) for ls in self._book.leases.values()
                           if ls.controller is not None]
            for lid, controller in watched:
                ref = self._pings.get(lid)
                if ref is None:
                    self._pings[lid] = controller.health.remote()
                    continue
                done, _ = ray.wait([ref], timeout=0)
                if not done:
                    continue  # busy with a long call: alive
                del self._pings[lid]
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - any failure of its controller
                    if boundary.is_death(e):
                        with self._cond:
                            ended.append((self._book.end(lid, reclaimed=True),
                                          "its controller died (the client's process exited)"))
            for lease, why in ended:
                if lease is not None:
                    logger.warning("service %s: took back %s of %s: %s", self.name, lease.id,
                                   lease.owner.get("user"), why)
                    self._take_back(lease, why)
            if dropped:
                with self._cond:
                    self._schedule_locked()
                    self._cond.notify_all()
            with self._cond:
                numbers = self._book.numbers(time.monotonic())
            self._metrics.update(numbers)


class _Metrics:
    """The service's numbers as Ray metrics (``ray.util.metrics``), exported by every
    node's metrics agent in Prometheus format as ``ray_pathways_ray_service_*``."""

    GAUGES = {
        "active_users": "users holding at least one lease",
        "leases": "leases held",
        "chips_in_use": "chips lent to leases",
        "chips_total": "chips in the pool (working)",
        "capacity_in_use": "fraction of the pool's chips lent to leases",
        "queue_length": "requests waiting for slices",
        "longest_wait_s": "seconds the oldest waiting request has waited",
    }

    def __init__(self, name: str):
        from ray.util.metrics import Gauge, Histogram

        tags = {"service": name}
        self._gauges = {}
        for key, what in self.GAUGES.items():
            g = Gauge(f"pathways_ray_service_{key}", description=what, tag_keys=("service",))
            g.set_default_tags(tags)
            self._gauges[key] = g
        self._wait = Histogram("pathways_ray_service_lease_wait_seconds",
                               description="seconds from a request to its lease",
                               boundaries=[0.1, 0.5, 1, 5, 30, 120, 600],
                               tag_keys=("service",))
        self._wait.set_default_tags(tags)

    def update(self, numbers: dict) -> None:
        for key, g in self._gauges.items():
            g.set(float(numbers[key]))

    def waited(self, seconds: float) -> None:
        self._wait.observe(max(seconds, 0.0))
