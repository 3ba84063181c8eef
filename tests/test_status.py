"""The status table, rendered from cluster views and registry records (pure)."""

from __future__ import annotations

from rich.console import Console

from pathways_ray.clusters.cluster import slices_from_nodes
from pathways_ray.observability.status import render_status
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


def _details(states_a=("RUNNING", "RUNNING"), target_a=2):
    """Serve's get_serve_instance_details() shape: app 'llm' with two replicas of model
    'smollm2' and its ingress; app 'chat' with one replica of 'smollm2-b'."""
    def rep(i, state, node):
        return {"replica_id": f"r{i}", "state": state, "node_id": node}

    return {"applications": {
        "llm": {"route_prefix": "/", "status": "RUNNING", "deployments": {
            "FailoverIngress": {"target_num_replicas": 1,
                                "replicas": [rep(9, "RUNNING", "head0000")]},
            "LLMServer:smollm2": {"target_num_replicas": target_a, "replicas": [
                rep(i, s, n) for i, (s, n) in enumerate(zip(
                    states_a, ("aaaaaaaa11", "cccccccc33"), strict=True))]}}},
        "chat": {"route_prefix": "/chat", "status": "DEPLOYING", "deployments": {
            "LLMServer:smollm2-b": {"target_num_replicas": 1,
                                    "replicas": [rep(5, "STARTING", "gone1234")]}}},
    }}


def test_serve_inventory_names_each_replicas_slice_and_the_apps_state():
    """`pathways-ray serve list`: per app its route and state (serving / degraded / Serve's
    own), per model replica its slice and host; the ingress is not a model."""
    from pathways_ray.serve.inventory import apps_from_details, render_apps

    hosts = {"aaaaaaaa11": ("s0", 0), "cccccccc33": ("s1", 0)}
    chat, llm = apps_from_details(_details(), hosts)
    assert (llm.name, llm.models, llm.state) == ("llm", ("smollm2",), "serving")
    assert [(r.slice, r.worker_id, r.healthy) for r in llm.replicas] == [
        ("s0", 0, True), ("s1", 0, True)]
    assert chat.state == "deploying" and chat.replicas[0].slice is None
    _, degraded = apps_from_details(_details(("RUNNING", "STARTING")), hosts)
    assert degraded.state == "degraded"  # still answers, on fewer slices
    text = render(render_apps([chat, llm]))
    assert "/chat" in text and "smollm2-b" in text and "degraded" not in text
    assert "s1" in text and "worker 0" in text and "starting" in text
    assert "(no Serve apps)" in render(render_apps([]))


def test_status_table_shows_what_each_slice_serves():
    from pathways_ray.serve.inventory import apps_from_details, replica_cell, serving_by_slice

    nodes = [node("aaaaaaaa11", "s0", 0), node("cccccccc33", "s1", 0)]
    slices = slices_from_nodes(nodes, {"aaaaaaaa11": {}, "cccccccc33": {}})
    apps = apps_from_details(_details(("RUNNING", "RECOVERING")),
                             {"aaaaaaaa11": ("s0", 0), "cccccccc33": ("s1", 0)})
    serving = {s: [replica_cell(r) for r in rs] for s, rs in serving_by_slice(apps).items()}
    text = render(render_status(slices, [], serving))
    assert "serves" in text and "llm/smollm2 running" in text
    assert "llm/smollm2 recovering" in text
    assert "serves" not in render(render_status(slices, []))  # no column without Serve


def _prom(worker: str, model: str, *, success: float, tokens: float, ttft_sum: float,
          ttft_n: float, running: float, kv: float) -> str:
    """One engine's lines as a Ray node exports them (labels trimmed to the telling ones)."""
    lab = f'WorkerId="{worker}",model_name="{model}",engine="0",Component="core_worker"'
    return "\n".join([
        "# TYPE ray_vllm_request_success_total counter",
        f'ray_vllm_request_success_total{{{lab},finished_reason="length"}} {success}',
        "# TYPE ray_vllm_generation_tokens_total counter",
        f"ray_vllm_generation_tokens_total{{{lab}}} {tokens}",
        "# TYPE ray_vllm_time_to_first_token_seconds histogram",
        f'ray_vllm_time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} {ttft_n}',
        f"ray_vllm_time_to_first_token_seconds_count{{{lab}}} {ttft_n}",
        f"ray_vllm_time_to_first_token_seconds_sum{{{lab}}} {ttft_sum}",
        "# TYPE ray_vllm_num_requests_running gauge",
        f"ray_vllm_num_requests_running{{{lab}}} {running}",
        "# TYPE ray_vllm_num_requests_waiting gauge",
        f"ray_vllm_num_requests_waiting{{{lab}}} 1",
        "# TYPE ray_vllm_kv_cache_usage_perc gauge",
        f"ray_vllm_kv_cache_usage_perc{{{lab}}} {kv}",
        "# TYPE ray_serve_num_http_requests_total counter",
        'ray_serve_num_http_requests_total{application="llm",route="/"} 7',
    ]) + "\n"


def test_serve_metrics_turn_two_scrapes_of_rays_metrics_into_figures_per_model():
    """`pathways-ray serve metrics`: counters' increase over the window, gauges summed
    over a model's engines (on two nodes here), the fullest KV cache, mean TTFT."""
    from pathways_ray.serve.metrics import figures, parse, render_figures

    before = parse([_prom("w1", "m", success=10, tokens=160, ttft_sum=2.0, ttft_n=10,
                          running=4, kv=0.1),
                    _prom("w2", "m", success=5, tokens=80, ttft_sum=1.0, ttft_n=5, running=4,
                          kv=0.2)])
    after = parse([_prom("w1", "m", success=30, tokens=480, ttft_sum=6.0, ttft_n=30,
                         running=3, kv=0.3),
                   _prom("w2", "m", success=25, tokens=400, ttft_sum=3.0, ttft_n=25,
                         running=5, kv=0.25)])
    (m,) = figures(before, after, 10.0)
    assert (m.model, m.replicas, m.running, m.waiting) == ("m", 2, 8, 2)
    assert m.requests_per_s == 4.0 and m.tokens_per_s == 64.0
    assert abs(m.ttft_s - 6.0 / 40) < 1e-9 and m.kv_cache_use == 0.3
    text = render(render_figures([m], 10.0))
    assert "150 ms" in text and "30.0%" in text and "64.0" in text
    assert "no vLLM engine" in render(render_figures([], 10.0))


def test_piped_tables_keep_whole_names():
    """Into a pipe (``pathways-ray serve list | cat``, ``status | cat``) tables keep whole
    names: rich's 80-column default cut them to "a…", "rou…", "degrad…"."""
    import os
    import subprocess
    import sys

    code = (
        "from pathways_ray.serve.cli import console\n"
        "from pathways_ray.serve.inventory import apps_from_details, render_apps\n"
        "from tests.test_status import _details\n"
        "hosts = {'aaaaaaaa11': ('s0', 0), 'cccccccc33': ('s1', 0)}\n"
        "console.print(render_apps(apps_from_details(_details(('RUNNING', 'STARTING')), "
        "hosts)))\n")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    assert "…" not in out, out
    for name in ("route", "degraded", "replica state", "smollm2-b"):
        assert name in out, out
