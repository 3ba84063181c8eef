"""The status table, rendered from cluster views and registry records (pure)."""

from __future__ import annotations

from rich.console import Console

from pathways_ray.cluster import slices_from_nodes
from pathways_ray.status import render_status
from tests.test_cluster_view import node


def render(table) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(table)
    return console.export_text()


def test_table_shows_every_host_and_worker_health():
    """One row per host with chips used and the health of that host's chip workers."""
    nodes = [node("aaaaaaaa11", "s0", 0), node("bbbbbbbb22", "s0", 1, alive=False),
             node("cccccccc33", "s1", 0), node("dddddddd44", "s1", 1)]
    slices = slices_from_nodes(nodes, {"aaaaaaaa11": {}, "cccccccc33": {"TPU": 4.0},
                                       "dddddddd44": {"TPU": 4.0}})
    registry = [{"name": "s0", "workers": [
        {"rank": r, "worker_id": r // 4, "chip": r % 4, "health": "ok" if r < 4 else "gone"}
        for r in range(8)]}]
    text = render(render_status(slices, registry))
    assert "s0 (degraded)" in text and "s1 (free)" in text
    assert "aaaaaaaa" in text and "4/4" in text
    assert "ranks 0-3: 4 ok" in text and "ranks 4-7: 4 gone" in text
    assert "dead" in text


def test_empty_cluster():
    """A cluster without TPU hosts renders a readable table, not an error."""
    assert "(no TPU hosts)" in render(render_status([], []))
