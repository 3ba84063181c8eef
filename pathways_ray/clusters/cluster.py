"""What TPU slices a Ray cluster has, read from its nodes' labels and resources.

Pure except ``cluster_slices()``: works on the dicts ``ray.nodes()`` and
``ray._private.state.available_resources_per_node()`` return, so it is tested
without Ray and used the same way on an emulated fleet and on real TPU hosts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pathways_ray.clusters.topology import Topology

__all__ = ["HostView", "SliceView", "cluster_slices", "describe_capacity", "slice_order",
           "slices_from_nodes"]


def slice_order(name: str) -> tuple:
    """Sort key of slice names in their numbers' order: v6e-2x2-2 before v6e-2x2-10."""
    import re

    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name))

SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
ACCELERATOR_LABEL = "ray.io/accelerator-type"


@dataclass(frozen=True)
class HostView:
    """One TPU host (one Ray node)."""

    node_id: str
    address: str
    slice_name: str
    worker_id: int
    pod_type: str
    topology: str
    alive: bool
    chips: int
    chips_free: int
    port: int = 0  # its raylet's (node manager's) port

    @property
    def chips_used(self) -> int:
        return self.chips - self.chips_free


@dataclass(frozen=True)
class SliceView:
    """One TPU slice: the hosts that share a ``ray.io/tpu-slice-name``."""

    name: str
    pod_type: str
    topology_name: str
    hosts: tuple[HostView, ...]

    @property
    def topology(self) -> Topology | None:
        """The slice's shape, or None when its labels do not describe one we know."""
        chips_per_host = max((h.chips for h in self.hosts), default=0)
        try:
            return Topology.parse(
                self.pod_type.rsplit("-", 1)[0],
                self.topology_name,
                chips_per_host=chips_per_host or None,
            )
        except ValueError:
            return None

    @property
    def alive_hosts(self) -> tuple[HostView, ...]:
        return tuple(h for h in self.hosts if h.alive)

    @property
    def chips(self) -> int:
        return sum(h.chips for h in self.alive_hosts)

    @property
    def chips_free(self) -> int:
        return sum(h.chips_free for h in self.alive_hosts)

    @property
    def intact(self) -> bool:
        """All hosts alive, every chip present, and TPU worker 0 among them."""
        topo = self.topology
        if topo is None:
            return False
        ids = sorted(h.worker_id for h in self.alive_hosts)
        return ids == list(range(topo.num_hosts)) and self.chips == topo.chips

    @property
    def idle(self) -> bool:
        return self.intact and self.chips_free == self.chips

    @property
    def state(self) -> str:
        if not self.intact:
            return "degraded"
        if self.chips_free == self.chips:
            return "free"
        if self.chips_free == 0:
            return "busy"
        return "partly busy"


def slices_from_nodes(
    nodes: Iterable[Mapping],
    available: Mapping[str, Mapping[str, float]] | None = None,
) -> list[SliceView]:
    """Group TPU nodes by slice name; non-TPU nodes (the head) are skipped.

    ``available`` maps node id -> available resources; without it every chip of
    a live host counts as free. Dead hosts are kept (``alive=False``) so a
    slice that lost a host shows as degraded rather than vanishing.
    """
    available = available or {}
    by_slice: dict[str, list[HostView]] = {}
    meta: dict[str, tuple[str, str]] = {}
    for node in nodes:
        labels = node.get("Labels") or {}
        name = labels.get(SLICE_NAME_LABEL)
        if not name or WORKER_ID_LABEL not in labels:
            continue
        resources = node.get("Resources") or {}
        chips = int(resources.get("TPU", 0))
        alive = bool(node.get("Alive"))
        node_id = node.get("NodeID", "")
        if not alive:
            free = 0
        elif node_id in available:
            # Ray drops a resource from the available map once none of it is left.
            free = int(available[node_id].get("TPU", 0))
        else:
            free = chips  # no report yet (a host that just joined)
        host = HostView(
            node_id=node_id,
            address=node.get("NodeManagerAddress", ""),
            slice_name=name,
            worker_id=int(labels[WORKER_ID_LABEL]),
            pod_type=labels.get(POD_TYPE_LABEL, ""),
            topology=labels.get(TOPOLOGY_LABEL, ""),
            alive=alive,
            chips=chips,
            chips_free=free,
            port=int(node.get("NodeManagerPort") or 0),
        )
        by_slice.setdefault(name, []).append(host)
        meta.setdefault(name, (host.pod_type, host.topology))
    out = []
    for name in sorted(by_slice):
        hosts = by_slice[name]
        # A host that died and came back has two node records; show the live one.
        latest: dict[int, HostView] = {}
        for h in sorted(hosts, key=lambda h: h.alive):
            latest[h.worker_id] = h
        pod_type, topo = meta[name]
        out.append(
            SliceView(
                name=name,
                pod_type=pod_type,
                topology_name=topo,
                hosts=tuple(latest[k] for k in sorted(latest)),
            )
        )
    return out


def describe_capacity(slices: Iterable[SliceView]) -> str:
    """One line per slice, e.g. ``v6e-2x4-0 (v6e-8, 2x4): busy, 0/8 chips free``."""
    lines = []
    for s in slices:
        dead = len(s.hosts) - len(s.alive_hosts)
        extra = f", {dead} host(s) down" if dead else ""
        lines.append(
            f"{s.name} ({s.pod_type}, {s.topology_name}): {s.state}, "
            f"{s.chips_free}/{s.chips} chips free{extra}"
        )
    return "\n".join(lines) if lines else "no TPU slices (no node has ray.io/tpu-slice-name)"


def hosts_answering(hosts: Iterable[HostView], timeout_s: float = 1.0) -> set[str]:
    """Node ids of the hosts whose raylet accepts a TCP connection now.

    Ray keeps a host whose raylet died "alive" until its health checks fail (seconds
    here, up to a minute with Ray's defaults); a refused connection tells at once.
    A frozen host still answers (its kernel accepts): that is for step deadlines."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    hosts = [h for h in hosts if h.alive and h.port]

    def answers(h: HostView) -> bool:
        try:
            with socket.create_connection((h.address, h.port), timeout=timeout_s):
                return True
        except OSError:
            return False

    if not hosts:
        return set()
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return {h.node_id for h, ok in zip(hosts, pool.map(answers, hosts), strict=True) if ok}


def cluster_slices() -> list[SliceView]:
    """The TPU slices of the Ray cluster this process is connected to, with free chips
    per host. The one place that reads Ray's private state API (free resources per
    node have no public call in Ray 2.60)."""
    import ray
    from ray._private.state import available_resources_per_node

    return slices_from_nodes(ray.nodes(), available_resources_per_node())
