"""Dispatch at pod scale, by simulation: controller and client CPU per step at 4, 64,
512 and 4,096 chips, with the command stream relayed through the hosts (fanout) and
sent by the controller to every chip itself (the old path), side by side.

    python benchmarks/dispatch_scale.py [--sizes 4 64 512 4096] [--max-batch 1]

Each size is one v5p slice (2x2x1, 4x4x4, 8x8x8, 16x16x16: 1 to 1,024 hosts of 4
chips) of simulated chips (``pathways_ray.emulation.simulate``): real command stream servers
(same protocol, acks, heartbeats, backpressure and relays), no XLA, many per
process. The client runs a dependent chain ``z = step(z)`` through the real
client and controller; ``--max-batch 1`` (the default) sends every step as a
batch of its own, the case where no per-batch cost is shared between steps.

Printed per size and path, CPU per step (every thread of a process, Ray's
included, by the scheduler's count in ns):
- dispatch: the controller's own forwarding of a batch (``submit``, on its actor
  thread; ``Controller.dispatch_stats``), exact whatever the simulation's speed;
- controller, client: each process's CPU over the run. The simulated chips share
  this machine's two cores, so a 4,096-chip step takes ~1-2 s here, and what the
  processes burn per second whatever they do (Ray's threads, the health monitor)
  is charged to each step many times over: read these at the smallest size;
- background: the controller's idle CPU, as a share of a core (the health monitor
  reads every stream 4 times a second: with one stream per chip it grows with them);
- parity point: the shortest step at which the controller and the client keep up
  with the chips, each on a core of its own: max(Ray's delivery of a call, measured
  at the smallest size as the controller's CPU net of dispatch, plus this size's
  dispatch; the client's, from the smallest size: it meets no chip during steps),
  divided by the share of the controller's core the background leaves.
Targets: parity point <= 2 ms at 4,096 chips; controller CPU per step at 4,096
chips <= 10x its value at 4.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import psutil
import ray
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray import LocalFleet
from pathways_ray.emulation.simulate import SimFleet
from pathways_ray.testing import DebugController

SHAPES = {4: "v5p-2x2x1", 64: "v5p-4x4x4", 512: "v5p-8x8x8", 4096: "v5p-16x16x16"}


def cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of ``pid``, in nanoseconds' resolution (the
    scheduler's own count; /proc/<pid>/stat ticks are 10 ms, as long as a step here)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total / 1e9


def measure(chips: int, fanout: int, max_batch: int, steps: int) -> dict:
    procs = max(1, min(16, chips // 256))
    with SimFleet([SHAPES[chips]], processes=procs) as sim:
        client = sim.connect(fanout=fanout, max_batch=max_batch,
                             controller_cls=DebugController)
        try:
            ctl, me = ray.get(client._controller.pid.remote()), os.getpid()
            name = client.slices[0].name
            mesh = client.mesh((chips,), ("chips",))
            z = client.device_put(np.ones((chips, 8), np.float32),
                                  NamedSharding(mesh, P("chips")))
            step = client.jit(lambda z: z * 0.5 + 1.0)

            def run(k: int) -> tuple[float, float, float, float]:
                nonlocal z
                d0 = client._call("dispatch_stats")
                c0, m0, t0 = cpu_s(ctl), cpu_s(me), time.perf_counter()
                for _ in range(k):
                    z = step(z)
                client._sync(name)
                client._call("drain", timeout="stream")  # every batch ran on every chip
                dt = time.perf_counter() - t0
                c1, m1 = cpu_s(ctl), cpu_s(me)
                d1 = client._call("dispatch_stats")
                submit = (d1["cpu_ns"] - d0["cpu_ns"]) / 1e9 / (d1["batches"] - d0["batches"])
                return dt / k, (c1 - c0) / k, (m1 - m0) / k, submit

            run(max(3, steps // 10))  # warm-up: the program's load, first batches
            # What the two processes burn idle (Ray's threads, the health monitor): here
            # the simulated chips make a step last far longer than on a real fleet, so
            # this per-second cost would be charged to each step many times over.
            c0, m0 = cpu_s(ctl), cpu_s(me)
            time.sleep(3.0)
            idle_ctl, idle_client = (cpu_s(ctl) - c0) / 3.0, (cpu_s(me) - m0) / 3.0
            wall, ctl_s, client_s, submit_s = run(steps)
            stats = sim.stats()
            assert all(s["missing_reads"] == 0 for s in stats), "a chip read a missing buffer"
            batches = {s["batches"] for s in stats}
            assert len(batches) == 1, f"chips ran different numbers of batches: {batches}"
        finally:
            client.close()
    return {"wall": wall, "ctl_raw": ctl_s, "client_raw": client_s, "submit": submit_s,
            "ctl": max(ctl_s - idle_ctl * wall, 1e-6),
            "client": max(client_s - idle_client * wall, 1e-6), "idle": idle_ctl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 64, 512, 4096],
                    choices=sorted(SHAPES))
    ap.add_argument("--max-batch", type=int, default=1, help="steps per batch at the client")
    ap.add_argument("--fanout", type=int, default=8, help="hosts each host relays to")
    ap.add_argument("--steps", type=float, default=1.0,
                    help="scale the number of measured steps (100 at 4 chips, 12 at 4,096)")
    args = ap.parse_args()
    # The simulated chips share two cores here: a 4,096-chip batch takes ~1.5 s to go
    # through all of them, and the health monitor must not take that for a frozen host.
    os.environ.setdefault("PATHWAYS_RAY_STEP_TIMEOUT_S", "600")
    os.environ.setdefault("PATHWAYS_RAY_STREAM_TIMEOUT_S", "900")

    rows = {}
    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="bscale"):
        print(f"{psutil.cpu_count()} CPUs; simulated v5p slices; {args.max_batch} step(s) per "
              f"batch; relay fanout {args.fanout} hosts")
        print(f"{'chips':>6} {'path':>7} {'dispatch/step':>14} {'controller/step':>16} "
              f"{'background':>11} {'client/step':>12} {'parity point':>13} "
              f"{'sim wall/step':>14}")
        for chips in args.sizes:
            steps = max(6, int(args.steps * {4: 300, 64: 150, 512: 40, 4096: 12}[chips]))
            for path, fanout in (("direct", 0), ("relay", args.fanout)):
                r = rows[(chips, path)] = measure(chips, fanout, args.max_batch, steps)
                # Per step: Ray's delivery of the call (the controller's CPU net of idle and
                # of submit's, at the smallest size, where a step is short) plus
                # submit's own; the client's from the smallest size (it never meets a chip
                # during steps); the background (the health monitor) takes its share of
                # the controller's core at every step rate.
                small = rows[(min(args.sizes), path)]
                ray_call = max(small["ctl"] - small["submit"], 0.0)
                r["parity"] = max(ray_call + r["submit"], small["client"]) / (1 - r["idle"])
                print(f"{chips:6d} {path:>7} {r['submit'] * 1e3:11.3f} ms "
                      f"{r['ctl_raw'] * 1e3:13.3f} ms {r['idle'] * 100:9.1f} % "
                      f"{r['client_raw'] * 1e3:9.3f} ms {r['parity'] * 1e3:10.3f} ms "
                      f"{r['wall'] * 1e3:11.1f} ms", flush=True)
    lo_n, hi_n = min(args.sizes), max(args.sizes)
    for path in ("direct", "relay"):
        lo, hi = rows[(lo_n, path)], rows[(hi_n, path)]
        ctl_lo = lo["ctl"] / (1 - lo["idle"])
        ctl_hi = (max(lo["ctl"] - lo["submit"], 0.0) + hi["submit"]) / (1 - hi["idle"])
        print(f"{path}: controller CPU per step at {hi_n} chips is {ctl_hi / ctl_lo:.1f}x its "
              f"value at {lo_n} (target <= 10x); parity point {hi['parity'] * 1e3:.2f} ms "
              f"(target <= 2 ms)")


if __name__ == "__main__":
    main()
