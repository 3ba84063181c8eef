"""The fleet status table: slices, hosts, chips, workers and their health.

``render_status`` is pure (cluster views and registry records in, a rich
``Table`` out); ``collect_status`` reads them from the connected cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.table import Table

from pathways_ray.clusters.cluster import SliceView

__all__ = ["collect_status", "render_status"]

_HEALTH_STYLE = {"ok": "green", "dead": "red", "gone": "red", "unresponsive": "yellow"}


def _workers_cell(workers: list[dict]) -> str:
    if not workers:
        return "-"
    counts: dict[str, int] = {}
    for w in workers:
        counts[w.get("health", "?")] = counts.get(w.get("health", "?"), 0) + 1
    parts = []
    for state in sorted(counts):
        style = _HEALTH_STYLE.get(state, "")
        text = f"{counts[state]} {state}"
        parts.append(f"[{style}]{text}[/{style}]" if style else text)
    ranks = sorted(w["rank"] for w in workers)
    return f"ranks {ranks[0]}-{ranks[-1]}: " + ", ".join(parts)


def render_status(slices: Sequence[SliceView], registered: Sequence[dict] = (),
                  serving: Mapping[str, Sequence[str]] | None = None) -> Table:
    """One row per TPU host, grouped by slice. ``serving`` (slice name -> one line per
    Serve replica it hosts, e.g. ``"llm/smollm2 running"``) adds a column when given."""
    by_slice = {r["name"]: r for r in registered}
    table = Table(title="pathways-ray fleet", title_justify="left")
    cols = ["slice", "pod type", "topology", "host", "node", "chips used", "host",
            "chip workers"] + (["serves"] if serving else [])
    for col in cols:
        table.add_column(col, no_wrap=col not in ("chip workers", "serves"))
    if not slices:
        table.add_row("(no TPU hosts)", *[""] * (len(cols) - 1))
    for s in slices:
        rec = by_slice.get(s.name)
        state_style = {"free": "green", "degraded": "red"}.get(s.state, "yellow")
        for i, h in enumerate(s.hosts):
            workers = [w for w in (rec or {}).get("workers", []) if w["worker_id"] == h.worker_id]
            health = "[green]alive[/green]" if h.alive else "[red]dead[/red]"
            table.add_row(
                f"{s.name} [{state_style}]({s.state})[/{state_style}]" if i == 0 else "",
                s.pod_type if i == 0 else "",
                s.topology_name if i == 0 else "",
                f"worker {h.worker_id}",
                h.node_id[:8],
                f"{h.chips_used}/{h.chips}" if h.alive else "-",
                health,
                _workers_cell(workers) if rec else "-",
                *(["\n".join(serving.get(s.name, ())) or "-" if i == 0 else ""]
                  if serving else []),
            )
        table.add_section()
    return table


def collect_status() -> tuple[list[SliceView], list[dict], dict[str, list[str]]]:
    """Slices, reserved-slice records and the Serve replicas each slice hosts, of the
    cluster this process is connected to (``render_status(*collect_status())``)."""
    from pathways_ray.clusters.cluster import cluster_slices
    from pathways_ray.clusters.registry import list_registered_slices

    return cluster_slices(), list_registered_slices(), _serving()


def _serving() -> dict[str, list[str]]:
    """Cells that installed parts add to each slice's row: every entry point of group
    ``pathways_ray.status`` is a function returning ``{slice name: [cell, ...]}``.
    Ray Serve's apps register one (``pathways_ray.serve.inventory.status_cells``), so
    the runtime never imports serving; a part that cannot load adds nothing."""
    from importlib.metadata import entry_points

    cells: dict[str, list[str]] = {}
    for ep in entry_points(group="pathways_ray.status"):
        try:
            column = ep.load()
        except ImportError:  # e.g. Ray Serve not installed: nothing is served
            continue
        for name, rows in column().items():
            cells.setdefault(name, []).extend(rows)
    return cells
