"""MaxText's own pre-train trainer through the IFRT proxy on 2 emulated v6e 2x2 slices,
beside the same mesh on 8 local CPU devices: do the losses agree, and what does a
step cost?

    python benchmarks/proxy_maxtext.py [--steps 20]

Through the proxy: data parallel across the slices over DCN (``dcn_data_parallelism=2``,
the mesh from ``create_hybrid_device_mesh``), FSDP over each slice's 4 chips; locally,
``ici_data_parallelism=2`` x ``ici_fsdp_parallelism=4`` on 8 XLA CPU devices in one
process. The same tiny model and synthetic data (``tests/test_proxy_clients.py``'s
settings). Prints every step's loss of both, their largest relative difference
(the test suite used to require <= 1e-5), and the median step time of each from
MaxText's own metrics (``perf/step_time_seconds``, the first 2 steps left out: they
compile). The MaxText client venv is ``tests/client_envs.py``'s (made on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _run(python, out: Path, env: dict, steps: int, *args: str) -> list[dict]:
    from tests.test_proxy_clients import maxtext

    out.mkdir()
    maxtext(python, out, env, f"steps={steps}", *args, timeout_s=1800)
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    from pathways_ray import LocalFleet
    from pathways_ray.proxy.server import ProxyServer
    from tests.client_envs import client_python

    python = client_python("maxtext")
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))}
    with tempfile.TemporaryDirectory() as tmp:
        local = _run(python, Path(tmp) / "local",
                     {**base, "JAX_PLATFORMS": "cpu",
                      "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
                     args.steps, "ici_data_parallelism=2", "ici_fsdp_parallelism=4")
        with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="bmaxtext",
                        log_to_driver=False):
            with ProxyServer(["v6e-2x2", "v6e-2x2"]) as server:
                through = _run(python, Path(tmp) / "proxy", {**base, **server.exports},
                               args.steps, "dcn_data_parallelism=2", "ici_fsdp_parallelism=4")
    worst = 0.0
    print(f"{'step':>4} {'local loss':>12} {'proxy loss':>12}")
    for i, (a, b) in enumerate(zip(local, through, strict=True)):
        la, lb = a["learning/loss"], b["learning/loss"]
        worst = max(worst, abs(la - lb) / abs(la))
        print(f"{i:>4} {la:>12.6f} {lb:>12.6f}")
    ms = {name: statistics.median(m["perf/step_time_seconds"] for m in run[2:]) * 1e3
          for name, run in (("local", local), ("proxy", through))}
    print(f"largest relative loss difference: {worst:.2e} (bound 1e-5)")
    print(f"median step: local JAX on 8 CPU devices {ms['local']:.1f} ms, through the proxy "
          f"on 2 slices {ms['proxy']:.1f} ms (local / proxy {ms['local'] / ms['proxy']:.2f})")


if __name__ == "__main__":
    main()
