"""2-D parallel PyTorch on TPU slices: FSDP2 across slices x tensor parallel inside each.

    python examples/train_torch_2d.py                 # 2 local emulated v6e 2x2 slices
    ray job submit --working-dir . -- python examples/train_torch_2d.py   # a running cluster

One worker per chip (``TorchTrainer``, ``ScalingConfig(use_tpu=True, ...)``). The
workers form a 2-D ``DeviceMesh`` (``pathways_ray.trainers.torch.slice_mesh``):
``tp`` runs along the chips of a slice, where the links are fast, with
``parallelize_module`` splitting attention heads and MLP units (Megatron-style
column / row parallel ``DTensor``s); ``dp`` runs across slices with FSDP2
(``fully_shard``), which shards what tensor parallelism left whole and averages
gradients over the slices. The losses match one process training the same model
on the same global batches (``reference_losses``; the test checks rtol 1e-5).
"""

from __future__ import annotations

import argparse
import json

import ray.train
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from pathways_ray.demo.lm import MarkovText
from pathways_ray.trainers import TorchTrainer
from pathways_ray.trainers.cli import add_slice_args, fit_on_slices, slice_topology
from pathways_ray.trainers.torch import get_device, slice_mesh
from pathways_ray.trainers.torch_lm import (
    TPLM,
    global_batch,
    lm_loss,
    shard_rows,
    tensor_parallel_plan,
    train_step,
)


def _optimizer(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config["lr"])


def train_loop(config: dict) -> None:
    mesh = slice_mesh(("dp", "tp"))
    torch.manual_seed(config["seed"])  # the same full model on every worker, then split
    model = TPLM(seq=config["seq"]).to(get_device())
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = _optimizer(model, config)
    text = MarkovText(64, seed=config["seed"])
    dp, dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")
    losses = []
    for step in range(config["steps"]):
        batch = global_batch(text, seed=config["seed"], step=step, batch=config["batch"],
                             seq=config["seq"])
        # the slice's rows, the same on each of its chips (tensor parallel splits the model)
        losses.append(train_step(model, opt, shard_rows(batch, dp_rank, dp).to(get_device())))
        if ray.train.get_context().get_world_rank() == 0 and (
                (step + 1) % config["report_every"] == 0 or step + 1 == config["steps"]):
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}", flush=True)
    ray.train.report({"step": config["steps"], "loss": losses[-1], "losses": losses,
                      "mesh": [dp, mesh["tp"].size()]})


def reference_losses(config: dict) -> list[float]:
    """The same training in this one process, unsharded: what the 2-D run must match."""
    torch.manual_seed(config["seed"])
    model = TPLM(seq=config["seq"])
    opt = _optimizer(model, config)
    text = MarkovText(64, seed=config["seed"])
    losses = []
    for step in range(config["steps"]):
        loss = lm_loss(model, global_batch(text, seed=config["seed"], step=step,
                                           batch=config["batch"], seq=config["seq"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> ray.train.Result:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_slice_args(ap, topology="2x2", slices=2, name="torch-2d", steps=20, report_every=5)
    ap.add_argument("--batch", type=int, default=32, help="global batch (rows)")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    topo = slice_topology(args)
    if 4 % topo.chips:
        raise SystemExit(f"--topology={args.topology}: tensor parallel splits 4 heads over "
                         f"the {topo.chips} chips of a slice; use a slice of 1, 2 or 4 chips")
    config = {"seed": 0, "steps": args.steps, "batch": args.batch, "seq": 32, "lr": args.lr,
              "report_every": args.report_every}
    result = fit_on_slices(TorchTrainer, train_loop, config, args)
    m = result.metrics
    print(f"final loss {m['loss']:.4f} after {m['step']} steps on {args.slices} x "
          f"{topo.describe()} (FSDP2 over {m['mesh'][0]} slices x tensor parallel over "
          f"{m['mesh'][1]} chips)")
    print(f"losses {json.dumps(m['losses'])}")
    return result


if __name__ == "__main__":
    main()
