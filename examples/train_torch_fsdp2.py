"""Fully sharded PyTorch (FSDP2, ``fully_shard``) on TPU chips with TorchTrainer.

    python examples/train_torch_fsdp2.py              # a local emulated v6e 2x4 slice
    ray job submit --working-dir . -- python examples/train_torch_fsdp2.py   # a running cluster

Every chip holds 1/N of each parameter and optimizer state (DTensors); the
checkpoint is sharded too: each worker writes its own shards with
``torch.distributed.checkpoint`` and Ray Train gathers them into one
checkpoint directory, which a rerun (or any number of processes) can load.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import ray.train
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

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
    for block in model.blocks:  # shard each block, then the rest (embeddings, head)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:  # resume from the sharded checkpoint, resharded to this world
        with checkpoint.as_directory() as d:
            model_state, opt_state = get_state_dict(model, opt)
            state = {"model": model_state, "opt": opt_state}
            dcp.load(state, checkpoint_id=d)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["opt"])
        start = checkpoint.get_metadata().get("step", 0)
    text = MarkovText(64, seed=config["seed"])
    tokens = config["batch"] * config["seq"]
    t0 = time.perf_counter()
    losses = []
    for step in range(start, config["steps"]):
        batch = global_batch(text, seed=config["seed"], step=step, batch=config["batch"],
                             seq=config["seq"])
        losses.append(train_step(model, opt, shard_rows(batch, rank, world).to(device)))
        done = step + 1
        if done % config["report_every"] and done != config["steps"]:
            continue
        metrics = {"step": done, "loss": losses[-1],
                   "tokens_per_s": tokens * len(losses) / (time.perf_counter() - t0)}
        if rank == 0:
            print(f"step {done:4d}  loss {losses[-1]:.4f}  "
                  f"{metrics['tokens_per_s']:,.0f} tokens/s", flush=True)
        with tempfile.TemporaryDirectory() as d:
            model_state, opt_state = get_state_dict(model, opt)
            # Each rank writes only its shards (and rank 0 the metadata) into its own
            # directory; Ray Train uploads every worker's files into one checkpoint.
            dcp.save({"model": model_state, "opt": opt_state}, checkpoint_id=d)
            ckpt = Checkpoint.from_directory(d)
            ckpt.set_metadata({"step": done})
            ray.train.report(metrics, checkpoint=ckpt)


def load_model(checkpoint_dir: str, seq: int = 32) -> TinyLM:
    """A plain (unsharded) ``TinyLM`` from a sharded checkpoint, in this one process."""
    model = TinyLM(seq=seq)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    model.load_state_dict(state["model"])
    return model


def main(argv: list[str] | None = None) -> ray.train.Result:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_slice_args(ap, topology="2x4", slices=1, name="torch-fsdp2")
    ap.add_argument("--batch", type=int, default=64, help="global batch (rows)")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    topo = slice_topology(args)
    config = {"seed": 0, "steps": args.steps, "batch": args.batch, "seq": 32, "lr": args.lr,
              "report_every": args.report_every}
    result = fit_on_slices(TorchTrainer, train_loop, config, args)  # one worker per chip
    m = result.metrics
    print(f"final loss {m['loss']:.4f} after {m['step']} steps on {args.slices} x "
          f"{topo.describe()} (FSDP2); {m['tokens_per_s']:,.0f} tokens/s; sharded checkpoint "
          f"{result.checkpoint.path}")
    return result


if __name__ == "__main__":
    main()
