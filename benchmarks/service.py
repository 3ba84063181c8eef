"""A lease of a shared service vs. a private controller, side by side in one run.

    python benchmarks/service.py [--reps 5] [--step-ms 2] [--seconds 1.0]

One emulated fleet of 2 x v6e 2x2: a service holds one slice, a private
``connect()`` the other (identical emulated hosts). Prints:
- dispatch: the same dependent chain of ~``--step-ms`` steps through a lease
  and through a private client, alternating, and their ratio (leased steps/s
  over private steps/s, median of back-to-back pairs; target >= 0.95);
- getting slices: ``connect(service=...)`` on an idle pool (the service's
  grant, then the lease's own controller) vs. a private ``connect()``, which
  reserves the slice and starts its chip workers and JAX world (target for the
  lease: <= 1 s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray import LocalFleet
from pathways_ray.client.connect import connect
from pathways_ray.service import control, leasing

DIM = 128


def make_step(iters: int):
    def step(z):
        def body(_, v):
            return jnp.tanh(v @ jnp.eye(DIM, dtype=v.dtype) * 0.9 + 0.01)
        z = jax.lax.fori_loop(0, iters, body, z)
        return z - z.mean()  # one all-reduce per step, like a gradient sync
    step.__name__ = f"step_{iters}"
    return step


class Chain:
    """A client's dependent chain of steps of one length."""

    def __init__(self, client, iters: int):
        mesh = client.mesh((4,), ("chips",))
        self.z0 = client.device_put(np.ones((32, DIM), np.float32),
                                    NamedSharding(mesh, P("chips")))
        self.fn = client.jit(make_step(iters))
        self.fn(self.fn(self.z0)).block_until_ready()  # load, compile, warm

    def run(self, k: int) -> float:
        z = self.z0
        t0 = time.perf_counter()
        for _ in range(k):
            z = self.fn(z)
        z.block_until_ready()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="pairs of runs; medians are printed")
    ap.add_argument("--step-ms", type=float, default=2.0, help="step length to dispatch")
    ap.add_argument("--seconds", type=float, default=1.0, help="work per run")
    args = ap.parse_args()

    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="bsvc"):
        control.start_service("bench", ["v6e-2x2"])
        private = connect(["v6e-2x2"])
        leased = connect(service="bench", slices={"v6e-2x2": 1})
        try:
            # Calibrate the step on the private client: ~step_ms per step.
            iters, per = 8, 0.0
            while iters < 1 << 16:
                probe = Chain(private, iters)
                per = probe.run(50) / 50
                if per >= args.step_ms / 1e3:
                    break
                iters *= 2
            iters = max(1, round(iters * args.step_ms / 1e3 / per))
            chains = {"private": Chain(private, iters), "leased": Chain(leased, iters)}
            k = max(50, int(args.seconds * 1e3 / args.step_ms))
            runs: dict[str, list[float]] = {"private": [], "leased": []}
            for rep in range(args.reps):
                order = ["leased", "private"] if rep % 2 else ["private", "leased"]
                for mode in order:
                    runs[mode].append(chains[mode].run(k))
            ratios = sorted(p / ls for p, ls in zip(runs["private"], runs["leased"], strict=True))
            step_ms = statistics.median(runs["private"]) / k * 1e3
            print(f"dispatch, {k} steps of {step_ms:.2f} ms, median of {args.reps} pairs:")
            print(f"  private controller {k / statistics.median(runs['private']):7.1f} steps/s")
            print(f"  lease of a service {k / statistics.median(runs['leased']):7.1f} steps/s")
            print(f"  ratio (lease / private) {statistics.median(ratios):.3f} "
                  f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}; target >= 0.95)")
        finally:
            leased.close()
            private.close()

        grants, leases, privates = [], [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            grant = leasing.lease("bench", {"v6e-2x2": 1})
            grants.append(time.perf_counter() - t0)
            control.get_service("bench").release.remote(grant["lease"], grant["token"])
            time.sleep(0.5)
            t0 = time.perf_counter()
            c = connect(service="bench", slices={"v6e-2x2": 1})
            leases.append(time.perf_counter() - t0)
            c.close()
        for _ in range(max(2, args.reps // 2)):
            t0 = time.perf_counter()
            c = connect(["v6e-2x2"])
            privates.append(time.perf_counter() - t0)
            c.close()
        g, ls, pv = (statistics.median(x) for x in (grants, leases, privates))
        print(f"getting a slice on an idle pool, median of {len(leases)} (private: "
              f"{len(privates)}):")
        print(f"  the service's grant alone      {g * 1e3:7.0f} ms")
        print(f"  connect(service=...) in all    {ls * 1e3:7.0f} ms (range "
              f"{min(leases) * 1e3:.0f}-{max(leases) * 1e3:.0f}; target <= 1000 ms)")
        print(f"  private connect()              {pv * 1e3:7.0f} ms (reserve, start chip "
              f"workers, JAX world)")
        print(f"  ratio (private / lease)        {pv / ls:7.1f}x")
        control.stop_service("bench")


if __name__ == "__main__":
    main()
