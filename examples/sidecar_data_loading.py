"""Train the demo LM on 2 slices with its text read and tokenized on the TPU hosts.

    python examples/sidecar_data_loading.py                   # 2 local emulated v6e 2x2 slices
    ray job submit --working-dir . -- python examples/sidecar_data_loading.py  # a cluster

A text file on storage every host sees (written here first: a shared path on
this machine, a bucket or a ReadWriteMany volume on GKE) is the dataset. Each
slice's hosts run a sidecar (``pathways_ray.elastic.feed.HostFeed``) that reads their
rows of the micro-batch the slice computes, tokenizes them and hands them to
their chips through the node's object store, two steps ahead of the training.
The client sends programs and step numbers, never input bytes: the script
prints the client's own byte counter to show it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import pathways_ray
from pathways_ray.demo.lm import LMConfig, init_params, loss_fn, param_specs
from pathways_ray.demo.text import TextBatches, write_corpus
from pathways_ray.elastic.data_parallel import DataParallelTrainer
from pathways_ray.elastic.feed import HostFeed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=16, help="rows per micro-batch (per slice)")
    ap.add_argument("--data-dir", default=None,
                    help="a directory every host sees (default: a temporary one here)")
    args = ap.parse_args()
    cfg = LMConfig()
    with tempfile.TemporaryDirectory() as tmp, pathways_ray.cluster_or_local(
            num_slices=2, accelerator="v6e", topology="2x2", log_to_driver=False):
        data_dir = Path(args.data_dir or tmp)
        data_dir.mkdir(parents=True, exist_ok=True)
        corpus = str(write_corpus(data_dir / "corpus.txt"))
        client = pathways_ray.connect(["v6e-2x2", "v6e-2x2"])
        try:
            slices = [s.name for s in client.slices]
            feed = HostFeed(TextBatches, (args.rows, cfg.seq + 1), np.int32,
                            args=(corpus, cfg.seq, args.rows))
            trainer = DataParallelTrainer(
                client, lambda p, b: loss_fn(p, b, cfg), init_params(cfg), param_specs(cfg),
                mesh_shape=(2, 2), lr=0.2, slices=slices, feed=feed)
            sent = client.counters["put_bytes"]  # the parameters, put once
            t0 = time.perf_counter()
            losses = []
            for step in range(args.steps):
                losses.append(trainer.step().mean_loss())
                if step % 10 == 0 or step == args.steps - 1:
                    print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
            took = time.perf_counter() - t0
            tokens = args.steps * len(slices) * args.rows * cfg.seq
            print(f"final loss {losses[-1]:.4f} after {args.steps} steps; "
                  f"{tokens / took:,.0f} tokens/s; input bytes sent by the client: "
                  f"{client.counters['put_bytes'] - sent}", flush=True)
        finally:
            client.close()


if __name__ == "__main__":
    main()
