"""Fleet bring-up time, the first all-reduce, and memory per chip worker.

    python benchmarks/fleet_startup.py [--slices 2 --accelerator v6e --topology 2x4
                                        --chips-per-host 4 --reps 20]

Side by side in one run:
- the first all-reduce of a slice (XLA compile + gloo connect) vs. the steady state;
- a chip worker (a Ray actor holding a JAX CPU device in a jax.distributed world)
  vs. a plain Ray actor on the same emulated host: what one emulated chip costs;
- memory of one emulated host's Ray processes (raylet and agents).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import psutil
import ray

from pathways_ray import LocalFleet, Slice


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--accelerator", default="v6e")
    ap.add_argument("--topology", default="2x4")
    ap.add_argument("--chips-per-host", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
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


if __name__ == "__main__":
    main()
