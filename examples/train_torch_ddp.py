"""Data-parallel PyTorch (DDP) on TPU chips with TorchTrainer: one worker per chip.

    python examples/train_torch_ddp.py                # a local emulated v6e 2x4 slice
    ray job submit --working-dir . -- python examples/train_torch_ddp.py   # a running cluster

Trains a small causal transformer LM on synthetic text (nothing downloads),
prints loss and throughput, and saves a checkpoint that a rerun resumes from.
The script never branches on hardware: ``get_device()`` gives the TPU device
(torch_tpu or PyTorch/XLA) on TPU hosts and the CPU on an emulated fleet.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import ray.train
import torch
from torch.nn.parallel import DistributedDataParallel

from pathways_ray.demo.lm import MarkovText
from pathways_ray.trainers import (
    Checkpoint,
    TorchTrainer,
)
from pathways_ray.trainers.cli import add_slice_args, fit_on_slices, slice_topology
from pathways_ray.trainers.torch import get_device
from pathways_ray.trainers.torch_lm import TinyLM, global_batch, shard_rows, train_step


def train_loop(config: dict) -> None:
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = get_device()
    torch.manual_seed(config["seed"])
    model = TinyLM(seq=config["seq"]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    start, losses = 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:  # resume: every worker loads the same replica
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, losses = state["step"], state["losses"]
    ddp = DistributedDataParallel(model)
    text = MarkovText(64, seed=config["seed"])
    tokens = config["batch"] * config["seq"]
    t0 = time.perf_counter()
    for step in range(start, config["steps"]):
        batch = global_batch(text, seed=config["seed"], step=step, batch=config["batch"],
                             seq=config["seq"])
        losses.append(train_step(ddp, opt, shard_rows(batch, rank, world).to(device)))
        done = step + 1
        if done % config["report_every"] and done != config["steps"]:
            continue
        metrics = {"step": done, "loss": losses[-1],
                   "tokens_per_s": tokens * (done - start) / (time.perf_counter() - t0)}
        if done == config["steps"]:
            metrics["losses"] = losses  # the whole curve, once
        if rank == 0:
            print(f"step {done:4d}  loss {losses[-1]:.4f}  "
                  f"{metrics['tokens_per_s']:,.0f} tokens/s", flush=True)
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:  # one replica is the whole model
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": done, "losses": losses}, os.path.join(d, "state.pt"))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d) if rank == 0
                             else None)


def reference_losses(config: dict) -> list[float]:
    """The same training in one process on the whole global batch (for the parity test)."""
    torch.manual_seed(config["seed"])
    model = TinyLM(seq=config["seq"])
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    text = MarkovText(64, seed=config["seed"])
    losses = []
    for step in range(config["steps"]):
        losses.append(train_step(model, opt, global_batch(
            text, seed=config["seed"], step=step, batch=config["batch"], seq=config["seq"])))
    return losses


def main(argv: list[str] | None = None) -> ray.train.Result:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_slice_args(ap, topology="2x4", slices=1, name="torch-ddp")
    ap.add_argument("--batch", type=int, default=64, help="global batch (rows)")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args(argv)
    topo = slice_topology(args)
    config = {"seed": 0, "steps": args.steps, "batch": args.batch, "seq": 32, "lr": args.lr,
              "report_every": args.report_every}
    result = fit_on_slices(TorchTrainer, train_loop, config, args)  # one worker per chip
    m = result.metrics
    print(f"final loss {m['loss']:.4f} after {m['step']} steps on {args.slices} x "
          f"{topo.describe()}; {m['tokens_per_s']:,.0f} tokens/s; checkpoint "
          f"{result.checkpoint.path}")
    return result


if __name__ == "__main__":
    main()
