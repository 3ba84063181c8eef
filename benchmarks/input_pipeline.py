"""Training input fed by the client vs. read on the hosts by sidecars, side by side.

    python benchmarks/input_pipeline.py [--steps 20] [--rows 16]

Two emulated v6e 2x2 slices train the demo LM data parallel
(``DataParallelTrainer``) on text read from a file and tokenized
(``pathways_ray.demo.text.TextBatches``). Input preparation is made to cost
what a step costs: each read of a micro-batch waits ``read_latency_s`` (an
object store's GET latency, emulated with a sleep; the tokenizing is real),
set from a step measured first so that preparing one global batch on the
client takes one step's time. The same model, fleet and batches, three ways:

- client, inline: the client reads the global batch, then runs the step;
- client, prefetch: a client thread reads the next batch while the step runs
  (the best a client can do; its one process still reads every host's data);
- sidecars: each host reads its slice's micro-batch two steps ahead
  (``HostFeed``); the client sends no input bytes.

Prints steps/s of each and the ratios; target: sidecars >= 1.5x client inline.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pathways_ray import LocalFleet, connect
from pathways_ray.demo.lm import LMConfig, init_params, loss_fn, param_specs
from pathways_ray.demo.text import TextBatches, write_corpus
from pathways_ray.elastic.data_parallel import DataParallelTrainer
from pathways_ray.elastic.feed import HostFeed


def _trainer(client, cfg, slices, **kw):
    return DataParallelTrainer(client, lambda p, b: loss_fn(p, b, cfg), init_params(cfg),
                               param_specs(cfg), mesh_shape=(2, 2), lr=0.2, slices=slices,
                               snapshot_every=None, **kw)


def _timed(step, steps: int, warm: int = 3) -> float:
    """Steps/s over ``steps`` steps after ``warm`` (compiling, filling the pipeline)."""
    for i in range(warm):
        step(i)
    t0 = time.perf_counter()
    for i in range(warm, warm + steps):
        step(i)
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=16, help="rows per micro-batch")
    args = ap.parse_args()
    cfg = LMConfig()
    with tempfile.TemporaryDirectory() as tmp, LocalFleet(
            num_slices=2, accelerator="v6e", topology="2x2", name="bench-input",
            log_to_driver=False):
        corpus = str(write_corpus(Path(tmp) / "corpus.txt"))
        client = connect()
        try:
            slices = [s.name for s in client.slices]
            m = len(slices)
            fast = TextBatches.on_client(corpus, cfg.seq, args.rows)
            base = _trainer(client, cfg, slices)
            step_s = 1.0 / _timed(lambda i: base.step(np.concatenate(
                [fast(i, j) for j in range(m)])).mean_loss(), args.steps)
            latency = step_s / m  # reading the m micro-batches of a step = one step
            print(f"a step with free input: {step_s * 1000:.0f} ms; each micro-batch read "
                  f"waits {latency * 1000:.0f} ms, so one global batch costs a step")

            read = TextBatches.on_client(corpus, cfg.seq, args.rows, read_latency_s=latency)

            def global_batch(i):
                return np.concatenate([read(i, j) for j in range(m)])

            inline = _trainer(client, cfg, slices)
            inline_sps = _timed(lambda i: inline.step(global_batch(i)).mean_loss(), args.steps)

            pool = ThreadPoolExecutor(1)
            ahead: dict[int, object] = {}
            pre = _trainer(client, cfg, slices)

            def prefetched(i):
                fut = ahead.pop(i, None) or pool.submit(global_batch, i)
                ahead[i + 1] = pool.submit(global_batch, i + 1)
                return pre.step(fut.result()).mean_loss()

            prefetch_sps = _timed(prefetched, args.steps)
            pool.shutdown(cancel_futures=True)

            feed = HostFeed(TextBatches, (args.rows, cfg.seq + 1), np.int32,
                            args=(corpus, cfg.seq, args.rows, latency))
            hosts = _trainer(client, cfg, slices, feed=feed)
            sent = client.counters["put_bytes"]
            host_sps = _timed(lambda i: hosts.step().mean_loss(), args.steps)
            host_bytes = client.counters["put_bytes"] - sent
        finally:
            client.close()
    batch_bytes = m * args.rows * (cfg.seq + 1) * 4
    print(f"\n{'input':<18}{'steps/s':>9}{'input bytes via client/step':>30}")
    print(f"{'client, inline':<18}{inline_sps:>9.2f}{batch_bytes:>30,}")
    print(f"{'client, prefetch':<18}{prefetch_sps:>9.2f}{batch_bytes:>30,}")
    print(f"{'sidecars':<18}{host_sps:>9.2f}{host_bytes // (args.steps + 3):>30,}")
    print(f"\nsidecars / client inline:   {host_sps / inline_sps:.2f}x  (target >= 1.5x)")
    print(f"sidecars / client prefetch: {host_sps / prefetch_sps:.2f}x")


if __name__ == "__main__":
    main()
