"""pathwaysutils.elastic through the IFRT proxy: a lost slice and its return, beside
``DataParallelTrainer``'s figures for the same failure on the same fleet.

    python benchmarks/proxy_elastic.py [--slices 3] [--steps 200] [--trainer-runs 3]

An unmodified JAX script (``tests/proxy_scripts.ELASTIC``: ``Manager().elastic_retry``
with ``minimum_slice_count=1``, a data-parallel mesh over every active slice's chips,
a ``ScaleUpSignalError`` at the first step boundary where a slice came back) trains
on ``--slices`` emulated v6e 2x2 slices through ``ProxyServer``. Slice 1's host is
killed for real (``LocalFleet.remove_host``) while it trains, and later restored.
Printed, from the script's own step timestamps:

- kill starts -> the first step done on N-1 slices (the issue's goal: <= 2 s);
- restore starts -> the first step done on N slices again (the host's Ray node
  joins, the controller reserves the replacement, pathwaysutils' monitor finds the
  slice active, the world is re-formed over all slices);
- the median step on N, N-1 and N slices again.

Then ``DataParallelTrainer`` (pathways-ray's own elastic trainer, the demo LM) on the
same fleet: ``--trainer-runs`` kills of a host after step 4, kill starts -> the first
step on the survivors (``benchmarks/elastic_recovery.py``'s ``recovery_runs``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
PAUSE_S = 0.05  # the script sleeps this after each step (not counted in a step)


def proxy_run(fleet, server, slices: int, steps: int) -> dict:
    from tests import proxy_scripts

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))}
    env.update(server.exports, ELASTIC_STEPS=str(steps), ELASTIC_PAUSE_S=str(PAUSE_S),
               PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="60")
    proc = subprocess.Popen([sys.executable, "-c", proxy_scripts.ELASTIC], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def steps_on(n: int, after: float = 0.0) -> list[float]:
        return [float(p[3]) for ln in list(lines) if ln.startswith("STEP")
                for p in [ln.split()] if p[2] == str(n) and float(p[3]) > after]

    def wait(cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{what} (within {timeout_s:g} s); the script said:\n"
                                 + "".join(lines[-15:]) + proc.stderr.read()[-3000:])
            time.sleep(0.05)

    try:
        wait(lambda: len(steps_on(slices)) >= 10, 300, f"no steps on {slices} slices")
        victim = next(ln.split()[1] for ln in lines if ln.startswith("SLICE1"))
        t_kill = time.time()
        killer = threading.Thread(target=fleet.remove_host, args=(victim, 0), daemon=True)
        killer.start()
        wait(lambda: len(steps_on(slices - 1, t_kill)) >= 10, 300,
             f"no steps on {slices - 1} slices after the kill")
        killer.join(60)
        t_back = time.time()
        fleet.restore_host(victim, 0)
        wait(lambda: len(steps_on(slices, t_back)) >= 5, 600,
             f"no steps on {slices} slices after the restore")
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    result = json.loads(next(ln for ln in lines if ln.startswith("RESULT"))
                        .removeprefix("RESULT"))
    stamps = [(int(p[2]), float(p[3])) for ln in lines if ln.startswith("STEP")
              for p in [ln.split()]]
    gaps = {n: [b - a - PAUSE_S for (m, a), (k, b) in itertools.pairwise(stamps)
                if m == k == n] for n in (slices, slices - 1)}
    return {"degraded_s": steps_on(slices - 1, t_kill)[0] - t_kill,
            "back_s": steps_on(slices, t_back)[0] - t_back,
            "step_s": {n: statistics.median(g) for n, g in gaps.items() if g},
            "attempts": result["attempts"], "steps": len(result["losses"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200,
                    help="steps of the proxy script (it must still run when the slice "
                         "comes back)")
    ap.add_argument("--trainer-runs", type=int, default=3,
                    help="DataParallelTrainer kills for its figure (0: skip)")
    args = ap.parse_args()
    if args.slices < 2:
        ap.error(f"--slices={args.slices}: a slice is lost and the run goes on, so 2 or more")

    from pathways_ray import LocalFleet
    from pathways_ray.cli.main import handle_sigterm_as_interrupt
    from pathways_ray.proxy.server import ProxyServer

    handle_sigterm_as_interrupt()  # a killed benchmark stops its fleet
    with LocalFleet(num_slices=args.slices, accelerator="v6e", topology="2x2",
                    name="bproxyel", log_to_driver=False) as fleet:
        server = ProxyServer(["v6e-2x2"] * args.slices)
        server.start()
        try:
            got = proxy_run(fleet, server, args.slices, args.steps)
        finally:
            server.stop()
        n = args.slices
        print(f"{n} x v6e 2x2 through the proxy, pathwaysutils.elastic (minimum_slice_count"
              f"=1), a host of slice 1 killed and restored:")
        print(f"  kill starts -> first step on {n - 1} slices   {got['degraded_s']:6.2f} s"
              f"  (goal <= 2 s)")
        print(f"  restore starts -> first step on {n} slices  {got['back_s']:6.2f} s")
        for k, v in got["step_s"].items():
            print(f"  median step on {k} slices                 {v * 1e3:6.1f} ms")
        print(f"  attempts {got['attempts']}, steps {got['steps']}")
        if args.trainer_runs:
            if n != 3:
                print("DataParallelTrainer's figure is taken on 3 slices (--slices 3)")
                return
            import elastic_recovery as er
            import numpy as np

            from pathways_ray.demo.lm import LMConfig, MarkovText

            cfg = LMConfig()
            rng, text = np.random.default_rng(0), MarkovText(cfg.vocab)
            batches = [text.batch(rng, er.BATCH, cfg.seq + 1) for _ in range(20)]
            runs = er.recovery_runs(fleet, cfg, batches, er._optimizer("adamw", 20),
                                    args.trainer_runs)
            times = [t for _, t in runs]
            med = statistics.median(times)
            print(f"DataParallelTrainer on the same fleet, {len(times)} kills: kill starts "
                  f"-> first step on {n - 1} slices median {med:.2f} s (min {min(times):.2f},"
                  f" max {max(times):.2f}); proxy / trainer = {got['degraded_s'] / med:.2f}")


if __name__ == "__main__":
    main()
