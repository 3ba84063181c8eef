"""Weight sync learner -> sampler: chip to chip vs. through the client vs. Ray's raw transfer.

    python benchmarks/weight_sync.py [--d-model 512] [--layers 4] [--reps 5]

Two emulated v6e 2x2 slices on two emulated hosts, as in the RL loop
(``pathways_ray.demo.rl``): the demo transformer's weights (a larger config,
~50 MB by default) sit on the learner slice in its data x model (2x2) layout
and go to the sampler slice in a model-parallel (1x4) layout. Each rep, in
turn:

- pull: ``client.reshard`` of the weights' pytree (what ``RLLoop`` does), each
  sampler chip pulling its blocks from the learner's chips over JAX's transfer
  server (``$PATHWAYS_RAY_TRANSFER=pull``, the default), until every chip of the
  sampler has its block;
- objects: the same reshard through the hosts' Ray object stores
  (``$PATHWAYS_RAY_TRANSFER=objects``, the path before chip-to-chip pulls);
- client: fetch every weight to the client, ``device_put`` it onto the sampler;
- raw Ray: the same number of bytes as one object (made beforehand), ``ray.put``
  by an actor on the learner's host and ``ray.get`` by an actor on the
  sampler's host: Ray's own transfer between two nodes, the ceiling for the
  refs path.

Prints the median throughput of each and the ratios (targets: pull >= 0.8 x raw
Ray; faster than the client path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import numpy as np
import ray
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pathways_ray import LocalFleet
from pathways_ray.client.connect import connect
from pathways_ray.demo.lm import LMConfig, init_params, param_specs


@ray.remote(num_cpus=0)
class Endpoint:
    """One end of a raw transfer, pinned to a host."""

    def __init__(self, nbytes: int = 0):
        self.data = np.ones(nbytes, np.uint8)  # made once, off the clock

    def put(self) -> list:
        return [ray.put(self.data)]

    def get(self, box: list) -> int:
        return int(ray.get(box[0]).nbytes)


def _on(node_id: str, nbytes: int = 0) -> Endpoint:
    return Endpoint.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id, soft=False)).remote(nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cfg = LMConfig(d_model=args.d_model, d_ff=4 * args.d_model, layers=args.layers, heads=4)
    specs = param_specs(cfg)
    host = init_params(cfg)
    nbytes = sum(v.nbytes for v in jax.tree.leaves(host))
    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="bsync",
                    object_store_mb=max(512, 8 * nbytes // 2**20), log_to_driver=False) as fleet:
        client = connect()
        try:
            learner, sampler = client.slices[0].name, client.slices[1].name

            def shardings(mesh):
                return jax.tree.map(lambda p: NamedSharding(mesh, p), specs,
                                    is_leaf=lambda x: isinstance(x, P))

            l_sh = shardings(client.mesh((2, 2), ("data", "model")))
            s_sh = shardings(client.mesh((1, 4), ("data", "model")))
            params = client.device_put(host, l_sh, slice=learner)
            client.block_until_ready(jax.tree.leaves(params))
            src = _on(fleet.node_ids[f"{learner}/0"], nbytes)
            dst = _on(fleet.node_ids[f"{sampler}/0"])

            def reshard(mode: str):
                def run() -> None:
                    os.environ["PATHWAYS_RAY_TRANSFER"] = mode
                    out = client.reshard(params, s_sh, slice=sampler)
                    client.block_until_ready(jax.tree.leaves(out), timeout_s=600)
                return run

            def via_client() -> None:
                values = jax.tree.map(lambda a: a.fetch(timeout_s=600), params)
                out = client.device_put(values, s_sh, slice=sampler)
                client.block_until_ready(jax.tree.leaves(out), timeout_s=600)

            def raw() -> None:
                assert ray.get(dst.get.remote(src.put.remote()), timeout=600) == nbytes

            paths = {"pull, chip to chip": reshard("pull"),
                     "objects, host stores": reshard("objects"),
                     "through the client": via_client, "raw Ray, node to node": raw}
            times: dict[str, list[float]] = {k: [] for k in paths}
            for fn in paths.values():  # warm: programs, actors, connections
                fn()
            for _ in range(args.reps):
                for name, fn in paths.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            leaves = len(jax.tree.leaves(host))
        finally:
            client.close()
    os.environ.pop("PATHWAYS_RAY_TRANSFER", None)
    print(f"\n{nbytes / 2**20:.1f} MiB of weights in {leaves} arrays, learner 2x2 (data x "
          f"model) -> sampler 1x4 (model), {args.reps} reps, medians")
    rate = {k: nbytes / statistics.median(v) for k, v in times.items()}
    for name, v in times.items():
        print(f"  {name:<24}{statistics.median(v) * 1e3:8.1f} ms {rate[name] / 2**20:8.1f} MiB/s")
    raw_rate = rate["raw Ray, node to node"]
    for name in ("pull, chip to chip", "objects, host stores"):
        print(f"{name}: {rate[name] / raw_rate:.2f} of raw Ray (target >= 0.8), "
              f"{rate[name] / rate['through the client']:.2f}x through the client")


if __name__ == "__main__":
    main()
