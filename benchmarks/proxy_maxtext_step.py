"""MaxText's tiny pre-train step through the IFRT proxy, beside the same run under
multi-controller JAX, on 4 chips of this machine.

    python benchmarks/proxy_maxtext_step.py [--steps 12]

Multi-controller: 4 processes of one CPU device each form one JAX world
(``jax.distributed`` on this host, gloo collectives), each running MaxText 0.2.5's
unmodified ``maxtext.trainers.pre_train.train`` under a 5-line launcher that joins the
world first (what a TPU VM does on its own; MaxText's own CPU path wants XPK's job
variables and a fixed port). Single-controller: one MaxText process through
``pathways-ray proxy`` onto one emulated v6e 2x2 slice (4 chip workers, each one CPU
device in a JAX world of its slice), its warm client taken at start. Same model,
batch and steps (``tests/test_proxy_clients.py``'s tiny model, synthetic data).

Printed: the median of each run's step times as MaxText logs them ("completed step:
N, seconds: S", steps 2 on: the first ones compile), their ratio (the proxy's steps
per second over multi-controller's), and both runs' first losses (the same model and
data: equal). The MaxText client venv is ``tests/client_envs.py``'s (made on first use).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAUNCHER = """
import os, runpy, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["MC_COORDINATOR"], int(os.environ["MC_NUM"]),
                           int(os.environ["MC_ID"]), local_device_ids=[0])
runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__", alter_sys=True)
"""

STEP = re.compile(r"completed step: (\d+), seconds: ([0-9.]+).*? loss: ([0-9.]+)")


def _steps(log: str) -> tuple[list[float], list[float]]:
    """(step seconds from step 2 on, losses) as MaxText logged them."""
    found = [(int(n), float(s), float(loss)) for n, s, loss in STEP.findall(log)]
    return [s for n, s, _ in found if n >= 2], [loss for _, _, loss in found]


def _base_env() -> dict:
    return {**{k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))}, "DECOUPLE_GCLOUD": "TRUE"}


def multi_controller(python: Path, out: Path, steps: int, timeout_s: float) -> str:
    """Process 0's log of a 4-process multi-controller run."""
    from tests.test_proxy_clients import maxtext_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = maxtext_command(python, out, f"steps={steps}")
    cmd = [cmd[0], "-c", LAUNCHER, *cmd[3:]]  # python -m train ... -> the launcher ...
    procs, paths = [], [out / f"process{i}.log" for i in range(4)]
    for i, path in enumerate(paths):  # to files: a full pipe would stall its process
        env = {**_base_env(), "JAX_PLATFORMS": "cpu", "MC_COORDINATOR": f"127.0.0.1:{port}",
               "MC_NUM": "4", "MC_ID": str(i)}
        with path.open("w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=out))
    try:
        for p in procs:
            p.wait(timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    logs = [path.read_text(errors="replace") for path in paths]
    for i, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"multi-controller process {i} exited {p.returncode}:\n"
                               + logs[i][-3000:])
    return logs[0]


def through_proxy(python: Path, out: Path, steps: int, timeout_s: float) -> str:
    from pathways_ray import LocalFleet
    from pathways_ray.proxy.server import ProxyServer
    from tests.test_proxy_clients import maxtext_command

    with LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="bmtstep",
                    log_to_driver=False) as fleet:
        server = ProxyServer(["v6e-2x2"], warm=True)
        server.fleet = fleet
        server.start()
        try:
            run = subprocess.run(maxtext_command(python, out, f"steps={steps}"),
                                 capture_output=True, text=True, timeout=timeout_s,
                                 env={**_base_env(), **server.exports}, cwd=out)
        finally:
            server.stop()
    if run.returncode != 0:
        raise RuntimeError(f"MaxText through the proxy exited {run.returncode}:\n"
                           + (run.stdout + run.stderr)[-3000:])
    return run.stdout + run.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="steps of each run (>= 4)")
    ap.add_argument("--timeout-s", type=float, default=900, help="per run")
    args = ap.parse_args()
    if args.steps < 4:
        ap.error(f"--steps={args.steps}: give 4 or more (the first 2 steps compile)")
    from tests.client_envs import client_python

    python = client_python("maxtext")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("multi-controller", multi_controller), ("proxy", through_proxy)):
            out = Path(tmp) / name
            out.mkdir()
            times, losses = _steps(run(python, out, args.steps, args.timeout_s))
            if len(times) < args.steps - 2:
                raise RuntimeError(f"{name}: MaxText logged {len(times)} timed steps")
            results[name] = (statistics.median(times), losses)
            print(f"{name:17s} median step {results[name][0] * 1000:8.1f} ms over "
                  f"{len(times)} steps; first losses {losses[:3]}", flush=True)
    mc, proxy = results["multi-controller"][0], results["proxy"][0]
    print(f"ratio (steps/s through the proxy over multi-controller JAX): {mc / proxy:.2f} "
          f"(target >= 0.8)")
    same = results["multi-controller"][1][0] == results["proxy"][1][0]
    print(f"first loss equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
