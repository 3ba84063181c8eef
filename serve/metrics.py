"""The live figures of what the cluster serves, from the metrics Ray already exports.

Ray Serve LLM runs vLLM with ``log_engine_metrics`` (vLLM's own metrics, recorded
through Ray's metrics) and Ray Serve records its own; every Ray node serves them in
Prometheus text format on its metrics export port, where Prometheus (or GKE's
managed collection) scrapes them. This module writes no metrics of its own: it
scrapes the same endpoints twice and turns the difference into the figures a
person looks at, per model: requests/s, generated tokens/s, mean time to first
token, requests running and waiting, and KV cache use.

``figures`` and ``render_figures`` are pure (Prometheus text in, rows and a rich
``Table`` out); ``scrape`` reads every live node of the connected cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

__all__ = ["ModelFigures", "Samples", "figures", "parse", "render_figures", "scrape"]

# vLLM's metric names as Ray exports them ("vllm:x" becomes "ray_vllm_x").
_V = "ray_vllm_"

Samples = dict[tuple[str, frozenset], float]  # (sample name, labels) -> value


@dataclass(frozen=True)
class ModelFigures:
    model: str
    requests_per_s: float
    tokens_per_s: float
    ttft_s: float | None  # mean over the window; None: no first token in it
    running: float
    waiting: float
    kv_cache_use: float | None  # 0..1, the fullest replica's
    replicas: int  # engines reporting


def parse(texts: Sequence[str]) -> Samples:
    """Samples of several nodes' Prometheus texts, summed where names and labels meet."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, frozenset(s.labels.items()))
                out[key] = out.get(key, 0.0) + s.value
    return out


def _by_model(samples: Samples, name: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for (n, labels), value in samples.items():
        if n == name:
            model = dict(labels).get("model_name", "?")
            out.setdefault(model, []).append(value)
    return out


def figures(before: Samples, after: Samples, window_s: float) -> list[ModelFigures]:
    """Per model: counters' increase over ``window_s`` and the gauges at its end."""
    if window_s <= 0:
        raise ValueError(f"window_s={window_s!r} must be positive (seconds between scrapes)")

    def rate(name: str) -> dict[str, float]:
        a, b = _by_model(after, name), _by_model(before, name)
        return {m: max(0.0, sum(v) - sum(b.get(m, []))) for m, v in a.items()}

    running = _by_model(after, _V + "num_requests_running")
    waiting = _by_model(after, _V + "num_requests_waiting")
    kv = _by_model(after, _V + "kv_cache_usage_perc")
    done = rate(_V + "request_success_total")
    tokens = rate(_V + "generation_tokens_total")
    ttft_sum = rate(_V + "time_to_first_token_seconds_sum")
    ttft_n = rate(_V + "time_to_first_token_seconds_count")
    models = sorted(set(running) | set(done) | set(tokens))
    return [ModelFigures(
        model=m,
        requests_per_s=done.get(m, 0.0) / window_s,
        tokens_per_s=tokens.get(m, 0.0) / window_s,
        ttft_s=ttft_sum[m] / ttft_n[m] if ttft_n.get(m) else None,
        running=sum(running.get(m, [])),
        waiting=sum(waiting.get(m, [])),
        kv_cache_use=max(kv[m]) if kv.get(m) else None,
        replicas=len(running.get(m, [])),
    ) for m in models]


def render_figures(rows: Sequence[ModelFigures], window_s: float) -> Table:
    table = Table(title=f"serving, last {window_s:g} s (Ray's metrics: vLLM and Ray Serve)",
                  title_justify="left")
    for col in ("model", "engines", "requests/s", "tokens/s", "TTFT mean", "running",
                "waiting", "KV cache"):
        table.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    if not rows:
        table.add_row("(no vLLM engine reports metrics)", *[""] * 7)
    for r in rows:
        table.add_row(r.model, str(r.replicas), f"{r.requests_per_s:.2f}",
                      f"{r.tokens_per_s:.1f}",
                      "-" if r.ttft_s is None else f"{r.ttft_s * 1000:.0f} ms",
                      f"{r.running:g}", f"{r.waiting:g}",
                      "-" if r.kv_cache_use is None else f"{r.kv_cache_use:.1%}")
    return table


def scrape(timeout_s: float = 5.0) -> list[str]:
    """Every live node's Prometheus text (its metrics export port) on the connected
    cluster; a node that does not answer within ``timeout_s`` is left out."""
    import urllib.request

    import ray

    texts = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                texts.append(r.read().decode("utf-8", errors="replace"))
        except OSError:
            continue
    return texts
