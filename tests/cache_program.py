"""A program for the compilation cache test, run by the test process on its fleet and
by a new process on a fresh fleet of its own (``python tests/cache_program.py CACHE``),
from this one file: a program's cache key covers its source locations."""

from __future__ import annotations

import json
import sys

import numpy as np


def unique_program(v):
    import jax.numpy as jnp

    return jnp.cos(v) * 1.2345 + 0.5  # its own constants: a cache key of its own


SLICE = "v6e-2x2-0"  # on the emulated fleet a slice keeps its own entries (chips/world.py)


def run(cache: str) -> list[dict]:
    """Connect, run the program once on slice ``SLICE`` (the test's fleet and the fresh
    one both have it), return each chip's cache counters."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pathways_ray import connect

    c = connect(compilation_cache_dir=cache)
    try:
        mesh = c.mesh((4,), ("data",))
        x = c.device_put(np.ones(8, np.float32), NamedSharding(mesh, P("data")),
                         slice=SLICE)
        out = c.jit(unique_program)(x).fetch()
        np.testing.assert_allclose(out, np.cos(1.0) * 1.2345 + 0.5, rtol=1e-6)
        return [w["compile_cache"] for w in c.stats()[SLICE]["workers"]]
    finally:
        c.close()


if __name__ == "__main__":
    from pathways_ray import LocalFleet

    with LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="tcache-fresh",
                    log_to_driver=False):
        print("COUNTERS " + json.dumps(run(sys.argv[1])), flush=True)
