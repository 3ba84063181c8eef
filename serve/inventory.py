"""What the cluster serves: each Ray Serve app, its models, and the slice that hosts
each model replica, with its state.

``apps_from_details`` and ``render_apps`` are pure (Serve's own instance details
and a node -> (slice, worker) map in, views and a rich ``Table`` out);
``served_apps`` reads them from the connected cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.table import Table

__all__ = ["AppView", "ReplicaView", "apps_from_details", "render_apps", "served_apps",
           "serving_by_slice"]

_STATE_STYLE = {"RUNNING": "green", "HEALTHY": "green", "STARTING": "yellow",
                "DEPLOYING": "yellow", "RECOVERING": "yellow", "UPDATING": "yellow",
                "PENDING_MIGRATION": "yellow", "STOPPING": "yellow", "UNHEALTHY": "red",
                "DEPLOY_FAILED": "red", "DELETING": "yellow"}


@dataclass(frozen=True)
class ReplicaView:
    app: str
    model: str
    replica_id: str
    state: str  # Serve's ReplicaState: STARTING, RUNNING, RECOVERING, ...
    node_id: str
    slice: str | None  # None: not on a TPU host (or its node is gone)
    worker_id: int | None

    @property
    def healthy(self) -> bool:
        return self.state == "RUNNING"


@dataclass(frozen=True)
class AppView:
    name: str
    route_prefix: str
    status: str  # Serve's ApplicationStatus
    message: str
    models: tuple[str, ...]
    replicas: tuple[ReplicaView, ...]
    wanted: int  # model replicas Serve aims for

    @property
    def state(self) -> str:
        """``serving`` (every wanted replica runs), ``degraded`` (some run: requests
        still succeed, on fewer slices), or Serve's own status when none runs."""
        running = sum(r.healthy for r in self.replicas)
        if running and running >= self.wanted:
            return "serving"
        if running:
            return "degraded"
        return self.status.lower()


def _text(value) -> str:
    return str(getattr(value, "value", value) or "")


def apps_from_details(details: Mapping, hosts: Mapping[str, tuple[str, int]]) -> list[AppView]:
    """Views of Serve's ``get_serve_instance_details()``; ``hosts`` maps a node id to
    its (slice name, worker id). A model deployment is named ``<Server>:<model id>``
    (Ray Serve LLM's naming); others (the ingress) count toward the app's status."""
    apps = []
    for name, app in sorted((details.get("applications") or {}).items()):
        models, replicas, wanted = [], [], 0
        for dep_name, dep in sorted((app.get("deployments") or {}).items()):
            if ":" not in dep_name:
                continue
            model = dep_name.split(":", 1)[1]
            models.append(model)
            wanted += int(dep.get("target_num_replicas") or 0)
            for r in dep.get("replicas") or []:
                node = r.get("node_id") or ""
                slice_name, worker = hosts.get(node, (None, None))
                replicas.append(ReplicaView(name, model, r.get("replica_id", ""),
                                            _text(r.get("state")), node, slice_name, worker))
        apps.append(AppView(name, app.get("route_prefix") or "", _text(app.get("status")),
                            app.get("message") or "", tuple(models), tuple(replicas), wanted))
    return apps


def serving_by_slice(apps: Sequence[AppView]) -> dict[str, list[ReplicaView]]:
    out: dict[str, list[ReplicaView]] = {}
    for app in apps:
        for r in app.replicas:
            if r.slice:
                out.setdefault(r.slice, []).append(r)
    return out


def replica_cell(r: ReplicaView) -> str:
    style = _STATE_STYLE.get(r.state, "")
    state = f"[{style}]{r.state.lower()}[/{style}]" if style else r.state.lower()
    return f"{r.app}/{r.model} {state}"


def render_apps(apps: Sequence[AppView]) -> Table:
    """One row per model replica, grouped by app."""
    table = Table(title="served on this cluster", title_justify="left")
    for col in ("app", "route", "state", "model", "replica", "slice", "host", "replica state"):
        table.add_column(col, no_wrap=True)
    if not apps:
        table.add_row("(no Serve apps)", "", "", "", "", "", "", "")
    for app in apps:
        style = {"serving": "green", "degraded": "yellow"}.get(app.state, "red")
        rows = app.replicas or (None,)
        for i, r in enumerate(rows):
            first = i == 0
            table.add_row(
                app.name if first else "",
                app.route_prefix if first else "",
                f"[{style}]{app.state}[/{style}]" if first else "",
                r.model if r else ", ".join(app.models) or "-",
                r.replica_id if r else "-",
                (r.slice or "-") if r else "-",
                (f"worker {r.worker_id}" if r.worker_id is not None else r.node_id[:8] or "-")
                if r else "-",
                replica_cell(r).split(" ", 1)[1] if r else app.message[:60],
            )
        table.add_section()
    return table


def served_apps() -> list[AppView]:
    """The Serve apps of the connected cluster ([] when Serve is not running)."""
    import ray

    try:  # Serve's controller, looked up without importing Ray Serve (slow) for nothing
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    except ValueError:
        return []
    from ray.serve.context import _get_global_client

    from pathways_ray.clusters.cluster import cluster_slices

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return []
    hosts = {h.node_id: (s.name, h.worker_id) for s in cluster_slices() for h in s.hosts}
    return apps_from_details(client.get_serve_details(), hosts)


def status_cells() -> dict[str, list[str]]:
    """What each slice serves, for ``pathways-ray status`` (its ``pathways_ray.status``
    entry point): one cell per replica."""
    return {name: [replica_cell(r) for r in rs]
            for name, rs in serving_by_slice(served_apps()).items()}
