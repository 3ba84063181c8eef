"""Fleet bring-up time, the first all-reduce, and memory per chip worker.

    python benchmarks/fleet_startup.py [--slices 2 --accelerator v6e --topology 2x4
                                        --chips-per-host 4 --reps 20]

Side by side in one run:
- the first all-reduce of a slice (XLA compile + gloo connect) vs. the steady state;
- a chip worker (a Ray actor holding a JAX CPU device in a jax.distributed world)
  vs. a plain Ray actor on the same emulated host: what one emulated chip costs;
- memory of one emulated host's Ray processes (raylet and agents);
- ``connect()`` (a controller and every slice's chip workers) with the client's
  settings passed as an argument, as it does, vs. as the controller's runtime_env
  (inherited by its chips), as it did until 2026-12-07;
- the fleet's stop (every process gone).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import psutil
import ray

from pathways_ray import LocalFleet, Slice, connect
from pathways_ray.config import settings_env


def mib(n: float) -> str:
    return f"{n / 2**20:7.1f} MiB"


def memory(pid: int) -> tuple[int, int]:
    p = psutil.Process(pid)
    return p.memory_info().rss, p.memory_full_info().uss


@ray.remote(num_cpus=0)
class Plain:
    def pid(self) -> int:
        import os

        return os.getpid()


def connect_with_runtime_env():
    """connect()'s controller as it was started until 2026-12-07: the client's settings
    as its runtime_env, which Ray starts through setup_worker.py (its chips too)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pathways_ray.client.client import Client
    from pathways_ray.controller.controller import Controller

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy=here,
                       runtime_env={"env_vars": settings_env()})(Controller).remote()
    return Client(actor)


def time_connects(reps: int) -> tuple[list[float], list[float]]:
    """Seconds per connect() + close(), the two ways alternating."""
    now, before = [], []
    for _ in range(reps):
        for out, start in ((now, connect), (before, connect_with_runtime_env)):
            t = time.perf_counter()
            start().close()
            out.append(time.perf_counter() - t)
    return now, before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--accelerator", default="v6e")
    ap.add_argument("--topology", default="2x4")
    ap.add_argument("--chips-per-host", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--connects", type=int, default=3, help="connect() pairs to time")
    args = ap.parse_args()

    t0 = time.perf_counter()
    fleet = LocalFleet(num_slices=args.slices, accelerator=args.accelerator,
                       topology=args.topology, chips_per_host=args.chips_per_host,
                       name="bench")
    with fleet:
        fleet_up = time.perf_counter() - t0
        hosts = len(fleet.hosts)
        t1 = time.perf_counter()
        first = Slice.reserve(fleet.topologies[0], timeout_s=120)
        slice_ready = time.perf_counter() - t1
        values = [np.float32(r + 1) for r in range(first.num_chips)]
        t2 = time.perf_counter()
        first.all_reduce(values)
        first_ar = time.perf_counter() - t2
        steady = []
        for _ in range(args.reps):
            t = time.perf_counter()
            first.all_reduce(values)
            steady.append(time.perf_counter() - t)
        rest = [Slice.reserve(t, timeout_s=120) for t in fleet.topologies[1:]]
        all_ready = time.perf_counter() - t0

        chip_mem = [memory(w.info.pid) for s in [first, *rest] for w in s.workers]
        host_node = first.workers[0].info.node_id
        plain = Plain.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                host_node, soft=False)).remote()
        plain_mem = memory(ray.get(plain.pid.remote(), timeout=60))
        chip_pids = {w.info.pid for s in [first, *rest] for w in s.workers}
        host_procs = [p for p in fleet.host_processes(first.name, 0) if p.pid not in chip_pids
                      and p.pid != ray.get(plain.pid.remote())]
        host_rss = sum(p.memory_info().rss for p in host_procs)
        for s in [first, *rest]:
            s.shutdown()
        now, before = time_connects(args.connects)
        t3 = time.perf_counter()
    fleet_down = time.perf_counter() - t3

    chips = sum(t.chips for t in fleet.topologies)
    med = statistics.median(steady)
    rss = statistics.mean(m[0] for m in chip_mem)
    uss = statistics.mean(m[1] for m in chip_mem)
    print(f"fleet: {args.slices} x {fleet.topologies[0].describe()} = {hosts} hosts, "
          f"{chips} chips, on {psutil.cpu_count()} CPUs")
    print(f"fleet up (head + {hosts} raylets)        {fleet_up:7.1f} s")
    print(f"first slice ready (reserve+workers+jax)  {slice_ready:7.1f} s")
    print(f"first all-reduce (compile + connect)     {first_ar * 1e3:7.1f} ms")
    print(f"steady all-reduce (median of {args.reps})        {med * 1e3:7.1f} ms   "
          f"first/steady = {first_ar / med:.1f}x")
    print(f"fleet up to every slice ready            {all_ready:7.1f} s")
    print(f"chip worker memory  RSS {mib(rss)}  USS {mib(uss)}   (mean of {len(chip_mem)})")
    print(f"plain Ray actor     RSS {mib(plain_mem[0])}  USS {mib(plain_mem[1])}   "
          f"chip/plain RSS = {rss / plain_mem[0]:.1f}x")
    print(f"one emulated host's Ray processes ({len(host_procs)}) RSS {mib(host_rss)}")
    a, b = statistics.median(now), statistics.median(before)
    print(f"connect() + close(), median of {len(now)}: settings as arguments {a:5.1f} s, "
          f"as a runtime_env {b:5.1f} s   ratio {a / b:.2f}")
    print(f"fleet down (every process gone)          {fleet_down:7.1f} s")


if __name__ == "__main__":
    main()
