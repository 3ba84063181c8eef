"""TorchTrainer DDP on an emulated TPU slice vs. plain torchrun-style processes.

    python benchmarks/trainer_overhead.py [--topology 2x2] [--steps 60] [--reps 2]

Both sides run the same DDP loop (the TinyLM of the examples, one worker per
chip, gloo, one thread per process) for the same steps. The torchrun side is
what `torchrun --nproc-per-node N` does: N local processes, MASTER_ADDR/PORT,
RANK, WORLD_SIZE, env:// rendezvous. Prints steady-state steps/s of each
(after warm-up steps), the ratio, and the start-up time of each (process
start to first step). Repetitions alternate which side goes first.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch.multiprocessing as mp

WARMUP = 5


def ddp_loop(steps: int, batch: int, rank: int, world: int) -> float:
    """The measured work: DDP steps of TinyLM; returns steady-state steps/s."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from pathways_ray.demo.lm import MarkovText
    from pathways_ray.trainers.torch_lm import TinyLM, global_batch, lm_loss, shard_rows

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    text = MarkovText(64)
    batches = [shard_rows(global_batch(text, seed=0, step=i, batch=batch, seq=32), rank, world)
               for i in range(steps)]
    t0 = 0.0
    for i, b in enumerate(batches):
        if i == WARMUP:
            t0 = time.perf_counter()
        loss = lm_loss(model, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (steps - WARMUP) / (time.perf_counter() - t0)


def _ray_train_loop(config: dict) -> None:
    import ray.train

    ctx = ray.train.get_context()
    t_first = time.time()
    rate = ddp_loop(config["steps"], config["batch"], ctx.get_world_rank(),
                    ctx.get_world_size())
    ray.train.report({"steps_per_s": rate, "t_first": t_first})


def run_trainer(workers: int, topology: str, steps: int, batch: int, storage: str) -> tuple:
    from pathways_ray.trainers import RunConfig, ScalingConfig, TorchTrainer

    t0 = time.time()
    result = TorchTrainer(
        _ray_train_loop, train_loop_config={"steps": steps, "batch": batch},
        scaling_config=ScalingConfig(use_tpu=True, accelerator_type="TPU-V6E",
                                     topology=topology, num_workers=workers,
                                     resources_per_worker={"TPU": 1}),
        run_config=RunConfig(name=f"bench-{time.time_ns()}", storage_path=storage),
    ).fit()
    return result.metrics["steps_per_s"], result.metrics["t_first"] - t0


def _torchrun_worker(rank: int, world: int, port: int, steps: int, batch: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method="env://")
    t_first = time.time()
    rate = ddp_loop(steps, batch, rank, world)
    if rank == 0:
        out.put((rate, t_first))
    dist.destroy_process_group()


def run_torchrun(workers: int, steps: int, batch: int) -> tuple:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    t0 = time.time()
    procs = [ctx.Process(target=_torchrun_worker, args=(r, workers, port, steps, batch, out))
             for r in range(workers)]
    for p in procs:
        p.start()
    rate, t_first = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return rate, t_first - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="2x2", help="v6e slice shape (2x2: 4 workers)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    import tempfile

    from pathways_ray import LocalFleet, Topology

    topo = Topology.parse("v6e", args.topology)
    workers = topo.chips
    rates: dict[str, list[float]] = {"trainer": [], "torchrun": []}
    starts: dict[str, list[float]] = {"trainer": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as storage, \
            LocalFleet(slices=[topo], name="btrain"):
        for rep in range(args.reps):
            order = ("trainer", "torchrun") if rep % 2 == 0 else ("torchrun", "trainer")
            for side in order:
                if side == "trainer":
                    rate, start = run_trainer(workers, topo.name, args.steps, args.batch,
                                              storage)
                else:
                    rate, start = run_torchrun(workers, args.steps, args.batch)
                rates[side].append(rate)
                starts[side].append(start)
                print(f"  rep {rep + 1} {side:9s} {rate:6.2f} steps/s  start-up {start:5.1f}s",
                      flush=True)
    tr, base = statistics.median(rates["trainer"]), statistics.median(rates["torchrun"])
    print(f"DDP TinyLM, {workers} workers (one per emulated v6e chip), {args.steps} steps "
          f"({WARMUP} warm-up), median of {args.reps}")
    print(f"  TorchTrainer (use_tpu)  {tr:6.2f} steps/s   start-up "
          f"{statistics.median(starts['trainer']):5.1f}s")
    print(f"  torchrun-style          {base:6.2f} steps/s   start-up "
          f"{statistics.median(starts['torchrun']):5.1f}s")
    print(f"  ratio                   {tr / base:6.2f}")


if __name__ == "__main__":
    main()
