"""The fleet status table: slices, hosts, chips, workers and their health.

``render_status`` is pure (cluster views and registry records in, a rich
``Table`` out); ``collect_status`` reads them from the connected cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from pathways_ray.cluster import SliceView

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


def render_status(slices: Sequence[SliceView], registered: Sequence[dict] = ()) -> Table:
    """One row per TPU host, grouped by slice."""
    by_slice = {r["name"]: r for r in registered}
    table = Table(title="pathways-ray fleet", title_justify="left")
    for col in ("slice", "pod type", "topology", "host", "node", "chips used", "host",
                "chip workers"):
        table.add_column(col, no_wrap=col != "chip workers")
    if not slices:
        table.add_row("(no TPU hosts)", "", "", "", "", "", "", "")
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
            )
        table.add_section()
    return table


def collect_status() -> tuple[list[SliceView], list[dict]]:
    """Slices and reserved-slice records of the cluster this process is connected to."""
    from pathways_ray.cluster import cluster_slices
    from pathways_ray.registry import list_registered_slices

    return cluster_slices(), list_registered_slices()
