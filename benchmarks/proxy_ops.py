"""Small ops through the IFRT proxy, beside the same ops through pathways-ray's own client
and in local JAX, on one emulated v6e 2x2 slice (4 chips); and how fast a session starts.

    python benchmarks/proxy_ops.py [--n 200] [--sessions 10]

Every op works on the slice's 4-chip mesh (an array's rows split over the chips):
- put 1 KiB / put 1 MiB: ``device_put`` of a host array, ``--n`` of them, then a wait
  for the last;
- jit dispatch: a chain ``z = f(z)`` of a one-add program, then a wait;
- round trip: ``z = f(z)`` then ``np.asarray(z)``, each time (dispatch + readback);
- step, host batch: a train step (a 512x128 batch, a 128x16 weight) whose batch is
  put from the host every step (as a data loader feeds it), then a wait;
- step, batch on chips: the same step on a batch already there (its chip time).
Columns: local JAX (4 XLA CPU devices in a process of its own), the client
(``client.device_put``/``client.jit`` in this process), the proxy (a plain JAX script
with ``JAX_PLATFORMS=proxy``, pathwaysutils), ms per op. Then ``jax.devices()`` of
``--sessions`` sessions one after another against the running proxy (a warm one: the
slice's chip workers up), median and worst, and the first session's (the warm client
made at start, or a cold connect with ``--cold``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

OPS = ["put 1 KiB", "put 1 MiB", "jit dispatch", "round trip", "step, host batch",
       "step, batch on chips"]

SCRIPT = """
import json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
if os.environ.get("JAX_PLATFORMS") == "proxy":
    import pathwaysutils
    pathwaysutils.initialize()
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n = int(sys.argv[1])
mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
RESULT = {}
""" + "\n".join([
    "def put(x): return jax.device_put(x, NamedSharding(mesh, P('data')))",
    "def jit(f): return jax.jit(f)",
    "def wait(x): return jax.block_until_ready(x)",
    "def fetch(x): return np.asarray(x)",
]) + """
exec(open(sys.argv[2]).read())
print("RESULT", json.dumps(RESULT), flush=True)
"""

# The ops, in terms of put/jit/wait/fetch (bound to JAX or to the client), timed.
OPS_SOURCE = """
import time
import numpy as np
import jax.numpy as jnp

def _timed(name, run, reps):
    run(2)  # compiles and first transfers
    t0 = time.perf_counter()
    run(reps)
    RESULT[name] = (time.perf_counter() - t0) * 1e3 / reps

small = np.ones(256, np.float32)
big = np.ones(1 << 18, np.float32)
inc = jit(lambda a: a + 1)

def puts(x):  # a slice runs its commands in order: the last one done, all are
    return lambda k: wait([put(x) for _ in range(k)][-1])

def chain(k):
    z = put(small)
    for _ in range(k):
        z = inc(z)
    wait(z)

def round_trip(k):
    z = put(small)
    for _ in range(k):
        z = inc(z)
        fetch(z)

def loss_and_grad(w, x, y):
    def loss(w):
        return jnp.mean((jnp.tanh(x @ w) - y) ** 2)
    l, g = jax_value_and_grad(loss)(w)
    return l, w - 0.1 * g

rng = np.random.default_rng(0)
batches = [(rng.standard_normal((512, 128), np.float32),
            rng.standard_normal((512, 16), np.float32)) for _ in range(8)]
step = jit(loss_and_grad)

def host_batches(k):
    w = put(np.zeros((128, 16), np.float32))
    for i in range(k):
        x, y = batches[i % 8]
        l, w = step(w, put(x), put(y))
    wait(w)

on_chips = [(put(x), put(y)) for x, y in batches]

def chip_batches(k):
    w = put(np.zeros((128, 16), np.float32))
    for i in range(k):
        l, w = step(w, *on_chips[i % 8])
    wait(w)

_timed("put 1 KiB", puts(small), n)
_timed("put 1 MiB", puts(big), max(n // 10, 5))
_timed("jit dispatch", chain, n)
_timed("round trip", round_trip, n)
_timed("step, host batch", host_batches, n)
_timed("step, batch on chips", chip_batches, n)
"""

SESSION = """
import json, time
import jax, pathwaysutils
pathwaysutils.initialize()
t0 = time.perf_counter()
jax.devices()
print("RESULT", json.dumps({"devices_s": time.perf_counter() - t0}), flush=True)
"""


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))}
    return {**env, **extra}


def _run(source: str, env: dict, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", source, *args], capture_output=True,
                         text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


def _ops_file(tmp: str) -> str:
    path = os.path.join(tmp, "ops.py")
    with open(path, "w") as f:
        f.write("from jax import value_and_grad as jax_value_and_grad\n" + OPS_SOURCE)
    return path


def client_ops(n: int, ops_path: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pathways_ray.client.connect import connect

    with connect(["v6e-2x2"]) as client:
        mesh = client.mesh((4,), ("data",))
        rows = NamedSharding(mesh, P("data"))
        scope = {
            "n": n, "RESULT": {},
            "put": lambda x: client.device_put(x, rows),
            "jit": client.jit,
            "wait": lambda x: [a.block_until_ready() for a in jax.tree.leaves(x)],
            "fetch": np.asarray,
        }
        exec(open(ops_path).read(), scope)
        return scope["RESULT"]


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="ops per measurement")
    ap.add_argument("--sessions", type=int, default=10, help="sessions one after another")
    ap.add_argument("--cold", action="store_true", help="no warm client (a connect per session)")
    args = ap.parse_args()

    from pathways_ray import LocalFleet
    from pathways_ray.proxy.server import ProxyServer

    with tempfile.TemporaryDirectory() as tmp:
        ops_path = _ops_file(tmp)
        local = _run(SCRIPT, _env({"JAX_PLATFORMS": "cpu", "XLA_FLAGS":
                                   "--xla_force_host_platform_device_count=4"}),
                     str(args.n), ops_path)
        with LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="bproxyops",
                        log_to_driver=False):
            native = client_ops(args.n, ops_path)
            with ProxyServer(["v6e-2x2"], warm=not args.cold) as server:
                env = _env({**server.exports, "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS": "120"})
                t0 = time.perf_counter()
                proxy = _run(SCRIPT, env, str(args.n), ops_path)
                first_session_s = time.perf_counter() - t0
                starts = [_run(SESSION, env)["devices_s"] for _ in range(args.sessions)]
                counts = dict(server.clients.counts)
    print(f"{'ms per op':<22} {'local JAX':>10} {'client':>8} {'proxy':>8} "
          f"{'proxy-client':>13}")
    for op in OPS:
        print(f"{op:<22} {local[op]:>10.3f} {native[op]:>8.3f} {proxy[op]:>8.3f} "
              f"{proxy[op] - native[op]:>13.3f}")
    chip = proxy["step, batch on chips"]
    print(f"step with a host batch through the proxy: {proxy['step, host batch'] - chip:.2f} "
          f"ms above the same step on a batch already on the chips (target <= 2 ms)")
    print(f"jax.devices() of {args.sessions} sessions one after another: median "
          f"{statistics.median(starts):.3f} s, worst {max(starts):.3f} s (target <= 1 s); "
          f"the ops script's whole run {first_session_s:.1f} s; pool {counts}")


if __name__ == "__main__":
    main()
