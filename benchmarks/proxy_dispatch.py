"""An unmodified JAX program through the IFRT proxy vs. the same steps through
pathways-ray's own client, on the same emulated slice.

    python benchmarks/proxy_dispatch.py [--steps 200] [--iters 1 30 300]

For each step size, a dependent chain z = step(z) runs ``--steps`` times, then waits:
- client: ``pathways_ray.connect`` + ``client.jit`` in this process;
- proxy: a plain JAX script (``JAX_PLATFORMS=proxy``, pathwaysutils) against
  ``ProxyServer`` in this process: ``jax.jit`` of the same function, the same chain.
Prints ms per step of both and their ratio (client / proxy: 1.0 means the proxy
costs nothing), and for the proxy the session's start (``jax.devices()``: it
reserves the slice) and the first call (compile on the chips).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SCRIPT = """
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
import pathwaysutils
pathwaysutils.initialize()
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
t0 = time.perf_counter()
devices = jax.devices()
start_s = time.perf_counter() - t0
mesh = Mesh(np.array(devices[:4]), ("data",))
out = {"start_s": start_s, "ms": {}, "first_s": {}}
for iters in json.loads(sys.argv[1]):
    def step(z, iters=iters):
        def body(_, v):
            return jnp.tanh(v @ jnp.eye(128, dtype=v.dtype) * 0.9 + 0.01)
        z = jax.lax.fori_loop(0, iters, body, z)
        return z - z.mean()
    f = jax.jit(step)
    z = jax.device_put(np.ones((512, 128), np.float32), NamedSharding(mesh, P("data")))
    t0 = time.perf_counter()
    z = f(z).block_until_ready()
    out["first_s"][iters] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(int(sys.argv[2])):
        z = f(z)
    z.block_until_ready()
    out["ms"][iters] = (time.perf_counter() - t0) * 1e3 / int(sys.argv[2])
print("RESULT", json.dumps(out), flush=True)
"""


def client_ms(iters_list: list[int], steps: int) -> dict[int, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pathways_ray.client.connect import connect

    out = {}
    with connect(["v6e-2x2"]) as client:
        mesh = client.mesh((4,), ("data",))
        for iters in iters_list:
            def step(z, iters=iters):
                def body(_, v):
                    return jnp.tanh(v @ jnp.eye(128, dtype=v.dtype) * 0.9 + 0.01)
                z = jax.lax.fori_loop(0, iters, body, z)
                return z - z.mean()
            step.__name__ = f"step_{iters}"
            f = client.jit(step)
            z = client.device_put(np.ones((512, 128), np.float32),
                                  NamedSharding(mesh, P("data")))
            z = f(z).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(steps):
                z = f(z)
            z.block_until_ready()
            out[iters] = (time.perf_counter() - t0) * 1e3 / steps
    return out


def proxy_run(iters_list: list[int], steps: int) -> dict:
    from pathways_ray.proxy.server import ProxyServer

    with ProxyServer(["v6e-2x2"]) as server:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))}
        env.update(server.exports, PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="120")
        out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(iters_list), str(steps)],
                             capture_output=True, text=True, timeout=1200, env=env)
        if out.returncode != 0:
            raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
        result = json.loads(line.removeprefix("RESULT"))
        result["stats"] = server.stats()
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per chain")
    ap.add_argument("--iters", type=int, nargs="+", default=[1, 30, 300],
                    help="matmuls per step (the step's length)")
    args = ap.parse_args()

    from pathways_ray import LocalFleet

    with LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="bproxy",
                    log_to_driver=False):
        native = client_ms(args.iters, args.steps)
        proxy = proxy_run(args.iters, args.steps)
    print(f"proxy session start (jax.devices(), reserves the slice): {proxy['start_s']:.2f} s")
    print(f"{'matmuls/step':>12} {'client ms':>10} {'proxy ms':>9} {'ratio':>6} "
          f"{'proxy first call s':>19}")
    for iters in args.iters:
        p = proxy["ms"][str(iters)]
        print(f"{iters:>12} {native[iters]:>10.2f} {p:>9.2f} {native[iters] / p:>6.2f} "
              f"{proxy['first_s'][str(iters)]:>19.2f}")
    s = proxy["stats"]
    print(f"bytes through the proxy: {s['host_bytes_in']} in, {s['host_bytes_out']} out")


if __name__ == "__main__":
    main()
