"""The shared service's book of slices, leases and the queue (pure: no Ray).

A service (``service.py``) owns a pool of slices; clients ask for slices by shape
and count (``connect(service=..., slices={"v6e-2x2": 1})``). ``LeaseBook`` decides
who gets what: it grants requests in arrival order, lets a later request through
only when it wants no shape an earlier waiting one wants (so nobody starves),
ends leases whose holder stopped beating, and counts what the service exports as
metrics. Every slice is in exactly one state, so capacity cannot leak:

- ``free``: idle, its chip workers bound to the pool (no lease can reach them);
- ``leased``: held by one lease;
- ``returning``: its lease ended, its chips are being cleaned (``bind`` to the pool);
- ``broken``: it failed; the service is reserving a replacement.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from pathways_ray.clusters.topology import Topology

__all__ = ["Lease", "LeaseBook", "Request", "parse_request", "render_status", "shape_key"]

# pathwaysutils' Shared Pathways Service spelling: "tpuv6e:2x2", "tpuv5p:2x2x2"
_PATHWAYS_SPELLING = re.compile(r"^tpu(?P<gen>v[0-9a-z]+):(?P<shape>\d+(?:x\d+)+)$")


def shape_key(topo: Topology) -> str:
    """What a request matches a pool slice by: generation and chip shape (``v6e-2x2``),
    not how the chips split into hosts."""
    return f"{topo.generation.name}-{topo.name}"


def _parse_shape(spec) -> Topology:
    if isinstance(spec, Topology):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"{spec!r} is not a slice shape")
    m = _PATHWAYS_SPELLING.match(spec.strip().lower())
    if m:
        return Topology.parse(m["gen"], m["shape"])
    return Topology.of(spec)


def parse_request(slices) -> tuple[tuple[str, int], ...]:
    """``{"v6e-2x4": 1}`` (or pathwaysutils' ``{"tpuv6e:2x2": 2}``, or a list of shapes,
    one slice each) as ``((shape key, count), ...)``, merged and sorted."""
    if isinstance(slices, (str, Topology)):
        slices = [slices]
    if isinstance(slices, Mapping):
        items = list(slices.items())
    elif isinstance(slices, (list, tuple)):
        items = [(s, 1) for s in slices]
    else:
        raise TypeError(f"slices={slices!r} must map slice shapes to counts, e.g. "
                        f"{{'v6e-2x2': 1}} or {{'tpuv6e:2x2': 2}}")
    if not items:
        raise ValueError("slices={} asks for nothing; ask for at least one slice, e.g. "
                         "{'v6e-2x2': 1}")
    wants: dict[str, int] = {}
    for spec, count in items:
        try:
            key = shape_key(_parse_shape(spec))
        except (TypeError, ValueError) as e:
            raise ValueError(f"slices: {spec!r} is not a slice shape ({e}); write it as "
                             f"'v6e-2x2' or 'tpuv6e:2x2'") from None
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"slices: the count of {spec!r} is {count!r}; give a positive "
                             f"number of slices")
        wants[key] = wants.get(key, 0) + count
    return tuple(sorted(wants.items()))


@dataclass
class Request:
    id: str
    owner: dict
    wants: tuple[tuple[str, int], ...]
    enqueued: float
    last_seen: float


@dataclass
class Lease:
    id: str
    owner: dict
    token: str
    slices: tuple[str, ...]
    granted: float
    waited_s: float
    last_beat: float
    controller: object = None  # the lease's controller actor, once the client attached it


@dataclass
class _Pool:
    shape: dict[str, str] = field(default_factory=dict)  # slice -> shape key
    chips: dict[str, int] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)  # slice -> free|leased|returning|broken
    holder: dict[str, str] = field(default_factory=dict)  # slice -> lease id


class LeaseBook:
    """Slices, leases and the queue of one service. Not thread-safe: the service
    guards it with one lock."""

    def __init__(self) -> None:
        self._pool = _Pool()
        self.leases: dict[str, Lease] = {}
        self.queue: list[Request] = []
        self._request_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self.granted_total = 0
        self.reclaimed_total = 0
        self.replaced_total = 0

    # ---- the pool ----------------------------------------------------------------
    def add_slice(self, name: str, topo: Topology) -> None:
        """A slice joins the pool free (at start, or a replacement of a broken one)."""
        self._pool.shape[name] = shape_key(topo)
        self._pool.chips[name] = topo.chips
        self._pool.state[name] = "free"

    def replace_slice(self, old: str, new: str, topo: Topology) -> None:
        """A new slice takes a broken one's place (it may have the same name: the hosts
        name their slice)."""
        for d in (self._pool.shape, self._pool.chips, self._pool.state, self._pool.holder):
            d.pop(old, None)
        self.add_slice(new, topo)
        self.replaced_total += 1

    def state(self, name: str) -> str:
        return self._pool.state[name]

    def slices(self, state: str | None = None) -> list[str]:
        return [n for n, s in self._pool.state.items() if state is None or s == state]

    def shape_of(self, name: str) -> str:
        return self._pool.shape[name]

    def returned(self, name: str, healthy: bool) -> None:
        """A returning slice is clean (free again) or found broken."""
        self._pool.state[name] = "free" if healthy else "broken"
        self._pool.holder.pop(name, None)

    def capacity(self) -> dict[str, int]:
        """Slices of each shape the pool has, working or not (what a request may ask)."""
        out: dict[str, int] = {}
        for key in self._pool.shape.values():
            out[key] = out.get(key, 0) + 1
        return out

    # ---- requests -------------------------------------------------------------------
    def request(self, owner: dict, wants: tuple[tuple[str, int], ...], now: float) -> Request:
        have = self.capacity()
        for key, count in wants:
            if have.get(key, 0) < count:
                pool = ", ".join(f"{n} x {k}" for k, n in sorted(have.items())) or "nothing"
                raise ValueError(f"slices: {count} x {key} asked, but this service's pool "
                                 f"has {pool}; ask for what it has, or start a service with "
                                 f"more slices")
        req = Request(f"r{next(self._request_ids)}", dict(owner), wants, now, now)
        self.queue.append(req)
        return req

    def position(self, request_id: str) -> int | None:
        """1 for the first in the queue; None when not queued."""
        for i, r in enumerate(self.queue):
            if r.id == request_id:
                return i + 1
        return None

    def touch(self, request_id: str, now: float) -> bool:
        for r in self.queue:
            if r.id == request_id:
                r.last_seen = now
                return True
        return False

    def cancel(self, request_id: str) -> None:
        self.queue = [r for r in self.queue if r.id != request_id]

    def schedule(self, now: float) -> list[tuple[Request, Lease]]:
        """Grant what fits, in queue order. A request may pass an earlier one that is
        still waiting only if it wants none of the shapes that one wants."""
        granted, blocked = [], set()
        for req in list(self.queue):
            keys = {k for k, _ in req.wants}
            if keys & blocked:
                continue
            picked = self._pick(req.wants)
            if picked is None:
                blocked |= keys
                continue
            self.queue.remove(req)
            lease = Lease(f"lease-{next(self._lease_ids)}", req.owner, secrets.token_hex(16),
                          tuple(picked), now, now - req.enqueued, now)
            for name in picked:
                self._pool.state[name] = "leased"
                self._pool.holder[name] = lease.id
            self.leases[lease.id] = lease
            self.granted_total += 1
            granted.append((req, lease))
        return granted

    def _pick(self, wants) -> list[str] | None:
        free = self.slices("free")
        picked = []
        for key, count in wants:
            mine = [n for n in free if self._pool.shape[n] == key][:count]
            if len(mine) < count:
                return None
            picked += mine
        return picked

    # ---- leases ---------------------------------------------------------------------
    def check(self, lease_id: str, token: str) -> Lease:
        """The lease, if ``token`` is its token; ``KeyError`` (no such lease) or
        ``ValueError`` (another token) else."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise KeyError(lease_id)
        if not secrets.compare_digest(lease.token, str(token)):
            raise ValueError(f"the token presented is not {lease_id}'s: every lease has its "
                             f"own, and only its holder has it")
        return lease

    def beat(self, lease_id: str, token: str, now: float) -> bool:
        try:
            self.check(lease_id, token).last_beat = now
            return True
        except KeyError:
            return False

    def end(self, lease_id: str, *, reclaimed: bool = False) -> Lease | None:
        """End a lease: its slices turn ``returning`` (the caller cleans and returns them)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        for name in lease.slices:
            if self._pool.holder.get(name) == lease_id:
                self._pool.state[name] = "returning"
        self.reclaimed_total += reclaimed
        return lease

    def expired(self, now: float, timeout_s: float) -> tuple[list[str], list[str]]:
        """Leases whose holder sent no heartbeat, and queued requests nobody polled, for
        ``timeout_s``."""
        leases = [lid for lid, ls in self.leases.items() if now - ls.last_beat > timeout_s]
        requests = [r.id for r in self.queue if now - r.last_seen > timeout_s]
        return leases, requests

    # ---- numbers --------------------------------------------------------------------
    def numbers(self, now: float) -> dict:
        """What the service exports as metrics (the first two are pathwaysutils' figures)."""
        states = self._pool.state
        total = sum(self._pool.chips[n] for n, s in states.items() if s != "broken")
        used = sum(self._pool.chips[n] for n, s in states.items() if s == "leased")
        users = {_user(ls.owner) for ls in self.leases.values()}
        return {
            "active_users": len(users),
            "leases": len(self.leases),
            "chips_in_use": used,
            "chips_total": total,
            "capacity_in_use": used / total if total else 0.0,
            "queue_length": len(self.queue),
            "longest_wait_s": max((now - r.enqueued for r in self.queue), default=0.0),
            "slices": {s: sum(1 for v in states.values() if v == s)
                       for s in ("free", "leased", "returning", "broken")},
            "granted_total": self.granted_total,
            "reclaimed_total": self.reclaimed_total,
            "replaced_total": self.replaced_total,
        }

    def snapshot(self, now: float) -> dict:
        """Everything ``pathways-ray service status`` shows."""
        return {
            "numbers": self.numbers(now),
            "slices": [{"name": n, "shape": self._pool.shape[n], "chips": self._pool.chips[n],
                        "state": s, "lease": self._pool.holder.get(n)}
                       for n, s in sorted(self._pool.state.items())],
            "leases": [{"id": ls.id, "user": _user(ls.owner), "slices": list(ls.slices),
                        "age_s": now - ls.granted, "waited_s": ls.waited_s,
                        "last_beat_s": now - ls.last_beat} for ls in self.leases.values()],
            "queue": [{"position": i + 1, "id": r.id, "user": _user(r.owner),
                       "wants": [f"{n} x {k}" for k, n in r.wants],
                       "waited_s": now - r.enqueued} for i, r in enumerate(self.queue)],
        }


def _user(owner: dict) -> str:
    return f"{owner.get('user', '?')}@{owner.get('host', '?')}"


def render_status(name: str, snap: dict):
    """The service's state as rich tables: capacity, slices, leases, queue."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    n = snap["numbers"]
    head = (f"service {name}: {n['active_users']} users, {n['leases']} leases, "
            f"{n['chips_in_use']}/{n['chips_total']} chips in use "
            f"({100 * n['capacity_in_use']:.0f}%), {n['queue_length']} waiting")
    slices = Table(title="slices", title_justify="left")
    for col in ("slice", "shape", "chips", "state", "lease"):
        slices.add_column(col)
    for s in snap["slices"]:
        slices.add_row(s["name"], s["shape"], str(s["chips"]), s["state"], s["lease"] or "")
    leases = Table(title="leases", title_justify="left")
    for col in ("lease", "user", "slices", "held", "waited", "last heartbeat"):
        leases.add_column(col)
    for ls in snap["leases"]:
        leases.add_row(ls["id"], ls["user"], ", ".join(ls["slices"]), f"{ls['age_s']:.0f} s",
                       f"{ls['waited_s']:.1f} s", f"{ls['last_beat_s']:.1f} s ago")
    parts = [Text(head), slices, leases]
    if snap["queue"]:
        queue = Table(title="queue", title_justify="left")
        for col in ("position", "request", "user", "wants", "waiting"):
            queue.add_column(col)
        for q in snap["queue"]:
            queue.add_row(str(q["position"]), q["id"], q["user"], ", ".join(q["wants"]),
                          f"{q['waited_s']:.0f} s")
        parts.append(queue)
    return Group(*parts)
