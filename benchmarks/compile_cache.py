"""Time to first step: compiling cold vs. loading from the cache vs. compiled ahead.

    python benchmarks/compile_cache.py [--repeats 2] [--layers 4]

One emulated v6e 2x2 slice; the demo LM's training step (value_and_grad and
an SGD update, one program). Every run is a new client with new chip workers
(new processes: nothing in memory), timed from the step's dispatch to its loss
on the client; the client's tracing and export (the same in every mode) are
done before the clock starts:

- cold: an empty compilation cache directory: every chip compiles;
- cached: the directory the cold run filled: every chip loads the executable
  (JAX's own hit/miss events are printed to show it);
- compiled ahead: no cache; ``client.jit(step).lower(...).compile()`` right
  after connecting, while the job does its other setup (here: putting the
  parameters), and the first step once it has finished.

Prints each mode's best of ``--repeats`` and the ratios to cold; target:
cached >= 5x faster than cold.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray import LocalFleet, connect
from pathways_ray.demo.lm import LMConfig, MarkovText, init_params, loss_fn, param_specs


def _run(cfg: LMConfig, cache: str | None, ahead: bool) -> tuple[float, float, dict]:
    """One new client: (first step s, compile-ahead s, cache counts summed over chips)."""
    client = connect(compilation_cache_dir=cache)
    try:
        mesh = client.mesh((2, 2), ("data", "model"))
        specs = jax.tree.map(lambda p: NamedSharding(mesh, p), param_specs(cfg),
                             is_leaf=lambda x: isinstance(x, P))
        batch_sh = NamedSharding(mesh, P("data"))

        def train_step(params, batch):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, cfg))(params)
            return jax.tree.map(lambda p, g: p - cfg.lr * g, params, grads), loss

        step = client.jit(train_step, out_shardings=(specs, NamedSharding(mesh, P())))
        params0 = init_params(cfg)
        batch0 = MarkovText(cfg.vocab).batch(np.random.default_rng(0), 16, cfg.seq + 1)
        abstract = (jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                                 params0, specs),
                    jax.ShapeDtypeStruct(batch0.shape, batch0.dtype, sharding=batch_sh))
        lowered = step.lower(*abstract)  # tracing and export: on the client, in every mode
        compile_s = 0.0
        if ahead:
            t0 = time.perf_counter()
            compiled = lowered.compile()
            params = client.device_put(params0, specs)  # the job's other setup meanwhile
            batch = client.device_put(batch0, batch_sh)
            compiled.block_until_ready(timeout_s=600)
            compile_s = time.perf_counter() - t0
        else:
            params = client.device_put(params0, specs)
            batch = client.device_put(batch0, batch_sh)
            client.block_until_ready([batch])
        t0 = time.perf_counter()
        _, loss = lowered(params, batch)
        loss.fetch(timeout_s=600)
        first = time.perf_counter() - t0
        counts = {"hits": 0, "misses": 0}
        workers = client.stats()[client.slices[0].name]["workers"]
        if cache:
            for w in workers:
                for k in counts:
                    counts[k] += w["compile_cache"][k]
        # On the chips: the first call's lowering and compiling (or cache load), slowest chip
        counts["chip_s"] = max(w["first_call_s"][lowered.program.fingerprint] for w in workers)
        return first, compile_s, counts
    finally:
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="demo LM layers (compile cost)")
    args = ap.parse_args()
    cfg = LMConfig(layers=args.layers)
    rows = {"cold": [], "cached": [], "compiled ahead": []}
    notes = {}
    with tempfile.TemporaryDirectory() as tmp, LocalFleet(
            num_slices=1, accelerator="v6e", topology="2x2", name="bench-cache",
            log_to_driver=False):
        for r in range(args.repeats):
            cache = str(Path(tmp) / f"cache-{r}")
            first, _, counts = _run(cfg, cache, ahead=False)
            rows["cold"].append(first)
            notes["cold"] = (f"{counts['misses']} misses, {counts['hits']} hits; on the chips "
                             f"{counts['chip_s']:.2f} s")
            first, _, counts = _run(cfg, cache, ahead=False)
            rows["cached"].append(first)
            notes["cached"] = (f"{counts['misses']} misses, {counts['hits']} hits; on the chips "
                               f"{counts['chip_s']:.2f} s")
            first, compile_s, _ = _run(cfg, None, ahead=True)
            rows["compiled ahead"].append(first)
            notes["compiled ahead"] = f"compiled ahead in {compile_s:.2f} s"
    cold = min(rows["cold"])
    print(f"\n{'first step':<16}{'best s':>8}{'cold / this':>13}   runs (s); cache lookups")
    for mode, times in rows.items():
        best = min(times)
        print(f"{mode:<16}{best:>8.2f}{cold / best:>12.1f}x   "
              f"{', '.join(f'{t:.2f}' for t in times)}; {notes[mode]}")
    print(f"\ncached: {cold / min(rows['cached']):.1f}x faster than cold (target >= 5x); "
          f"compiled ahead: {cold / min(rows['compiled ahead']):.1f}x")


if __name__ == "__main__":
    main()
