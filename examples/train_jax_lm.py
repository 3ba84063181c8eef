"""A small transformer LM in JAX on TPU slices with JaxTrainer, in either mode.

    python examples/train_jax_lm.py                          # 2 local emulated v6e 2x2 slices
    python examples/train_jax_lm.py --mode single_controller # the same, one controller
    ray job submit --working-dir . -- python examples/train_jax_lm.py   # a running cluster

Data x model parallel within each slice (batch over ``data``, attention heads
and MLP over ``model``), data parallel across slices, synthetic text (nothing
downloads). Trained as transformers are: AdamW with a linear warm-up and a cosine
decay (``--lr`` is the peak), the gradients' global norm clipped to 1; with
``--microbatches K`` each step accumulates K micro-batches per slice (a global
batch larger than one step holds), with ``--bf16`` it computes in bfloat16 and
keeps float32 master weights. Prints loss and throughput and saves the parameters
as a checkpoint.

``multi_controller`` (Ray Train as usual): every worker runs ``train_loop``,
one JAX process per chip, all slices in one ``jax.distributed`` world.
``single_controller``: ``train_loop_single_controller`` runs once and
dispatches compiled steps to the slices through a ``pathways_ray`` client.
The same seed gives the same losses in both modes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import ray.train

from pathways_ray.demo.lm import LMConfig, MarkovText, init_params, loss_fn, param_specs
from pathways_ray.elastic.optim import adamw_warmup_cosine, init_state, opt_shardings, step_fns
from pathways_ray.trainers import (
    Checkpoint,
    JaxTrainer,
    get_client,
)
from pathways_ray.trainers.cli import add_slice_args, fit_on_slices, slice_topology


def _batch(text: MarkovText, config: dict, step: int) -> np.ndarray:
    """The global batch of ``step``, identical on every process and in both modes."""
    rng = np.random.default_rng([config["seed"], step])
    return text.batch(rng, config["batch"], LMConfig().seq + 1)


def _report(config: dict, done: int, losses: list[float], t_first: float,
            params=None) -> None:
    """Report metrics (and, with ``params``, a checkpoint); ``t_first`` is when the first
    (compiling) step finished, so throughput counts the steps after it."""
    steady = len(losses) - 1
    metrics = {"step": done, "loss": losses[-1],
               "tokens_per_s": config["batch"] * LMConfig().seq * steady
               / max(1e-9, time.perf_counter() - t_first)}
    if done == config["steps"]:
        metrics["losses"] = losses
    if ray.train.get_context().get_world_rank() == 0:
        print(f"step {done:4d}  loss {losses[-1]:.4f}  {metrics['tokens_per_s']:,.0f} tokens/s",
              flush=True)
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if params is not None:
            np.savez(os.path.join(d, "params.npz"), **_flat(params))
            checkpoint = Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def _optimizer(config: dict):
    """AdamW, warm-up over the first tenth of the run then cosine decay, clipping at 1."""
    return adamw_warmup_cosine(config["lr"], config["steps"], clip_norm=1.0)


def _compute_dtype(config: dict):
    import jax.numpy as jnp

    return jnp.bfloat16 if config.get("bf16") else None


def _flat(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = np.asarray(v)
    return out


def train_loop(config: dict) -> None:
    """Multi-controller: runs on every worker (one JAX process per chip)."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = LMConfig()
    model, k = config["model_parallel"], config.get("microbatches", 1)
    # Processes are ranked slice by slice, so slices are contiguous along "data".
    mesh = Mesh(np.array(jax.devices()).reshape(-1, model), ("data", "model"))
    shard = jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(cfg),
                         is_leaf=lambda x: isinstance(x, P))
    batch_sharding, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def put(host, sharding):  # every process holds the whole host array; each places its part
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    host = init_params(cfg, config["seed"])
    opt = _optimizer(config)
    host_state = init_state(opt, host)  # {"params", "opt"}: AdamW keeps its moments
    state_sharding = {"params": shard,
                      "opt": opt_shardings(host_state["opt"], host, shard, replicated)}
    state = jax.tree.map(put, host_state, state_sharding)
    # The single controller's arithmetic (pathways_ray.elastic.optim), on one global batch
    # of k micro-batches: the same optimizer, accumulation and compute dtype.
    fns = step_fns(lambda p, b: loss_fn(p, b, cfg), host, opt, microbatches=k, total=k,
                   compute_dtype=_compute_dtype(config))

    step = jax.jit(fns.step, out_shardings=(state_sharding, replicated))
    if k > 1:
        batch_sharding = NamedSharding(mesh, P(None, "data"))
    text = MarkovText(cfg.vocab, seed=config["seed"])
    losses: list[float] = []
    t_first = 0.0
    for i in range(config["steps"]):
        batch = _batch(text, config, i)
        if k > 1:
            batch = batch.reshape(k, -1, *batch.shape[1:])
        state, loss = step(state, put(batch, batch_sharding))
        losses.append(float(loss))
        t_first = t_first or time.perf_counter()
        done = i + 1
        if done == config["steps"]:
            host = multihost_utils.process_allgather(state["params"], tiled=True)
            _report(config, done, losses, t_first,
                    params=host if ray.train.get_context().get_world_rank() == 0 else None)
        elif done % config["report_every"] == 0:
            _report(config, done, losses, t_first)


def train_loop_single_controller(config: dict) -> None:
    """Single controller: runs once; the slices run the compiled steps."""
    from pathways_ray.elastic.data_parallel import DataParallelTrainer

    client = get_client()
    cfg = LMConfig()
    chips = client.slices[0].chips
    model = config["model_parallel"]
    trainer = DataParallelTrainer(client, lambda p, b: loss_fn(p, b, cfg),
                                  init_params(cfg, config["seed"]), param_specs(cfg),
                                  mesh_shape=(chips // model, model),
                                  optimizer=_optimizer(config),
                                  microbatches=config.get("microbatches", 1),
                                  compute_dtype=_compute_dtype(config))
    text = MarkovText(cfg.vocab, seed=config["seed"])
    losses: list[float] = []
    t_first = 0.0
    pending = None
    for i in range(config["steps"] + 1):
        result = trainer.step(_batch(text, config, i)) if i < config["steps"] else None
        if pending is not None:  # read step i-1's loss while step i runs
            losses.append(pending.mean_loss())
            t_first = t_first or time.perf_counter()
            if i == config["steps"]:
                _report(config, i, losses, t_first, params=trainer.fetch_params())
            elif i % config["report_every"] == 0:
                _report(config, i, losses, t_first)
        pending = result


def main(argv: list[str] | None = None) -> ray.train.Result:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_slice_args(ap, topology="2x2", slices=2, name="jax-lm")
    ap.add_argument("--mode", choices=["multi_controller", "single_controller"],
                    default="multi_controller")
    ap.add_argument("--model-parallel", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="global batch (rows)")
    ap.add_argument("--lr", type=float, default=1e-2, help="AdamW's peak learning rate")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="micro-batches per slice and step, accumulated")
    ap.add_argument("--bf16", action="store_true",
                    help="compute in bfloat16, keep float32 master weights")
    args = ap.parse_args(argv)
    topo = slice_topology(args)
    config = {"seed": 0, "steps": args.steps, "batch": args.batch, "lr": args.lr,
              "model_parallel": args.model_parallel, "report_every": args.report_every,
              "microbatches": args.microbatches, "bf16": args.bf16}
    loop = train_loop if args.mode == "multi_controller" else train_loop_single_controller
    args.name = f"{args.name}-{args.mode}"
    result = fit_on_slices(JaxTrainer, loop, config, args, mode=args.mode)
    m = result.metrics
    print(f"final loss {m['loss']:.4f} after {m['step']} steps on {args.slices} x "
          f"{topo.describe()} ({args.mode}); {m['tokens_per_s']:,.0f} tokens/s; checkpoint "
          f"{result.checkpoint.path}")
    return result


if __name__ == "__main__":
    main()
