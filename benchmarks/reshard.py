"""Moving an array slice -> slice: chip to chip vs. through the controller.

    python benchmarks/reshard.py [--mib 64] [--reps 7]

Two emulated v6e 2x2 slices on two emulated hosts. The same 64 MiB array
(sharded over 4 chips) goes from one slice to the other and back, either with
the chips copying it themselves (what pathways_ray.reshard does: pulls over
JAX's transfer server, or Ray objects with PATHWAYS_RAY_TRANSFER=objects) or
with the bytes routed through the controller process. Prints the median
time of each and the median ratio over back-to-back pairs (target >= 2x).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray import LocalFleet
from pathways_ray.client.connect import connect
from pathways_ray.config import transfer_mode
from pathways_ray.testing import DebugController, reshard_via_controller


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rows = args.mib * 2**20 // (4 * 1024)
    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="bresh",
                    object_store_mb=max(512, 6 * args.mib)):
        client = connect(controller_cls=DebugController)
        mesh = client.mesh((4,), ("chips",))
        sharding = NamedSharding(mesh, P("chips"))
        x = client.device_put(np.ones((rows, 1024), np.float32), sharding, slice=0)
        x.block_until_ready()
        times: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(args.reps + 1):  # the first round warms up both paths
            for via in ((False, True) if rep % 2 else (True, False)):  # alternate the order
                t0 = time.perf_counter()
                y = (reshard_via_controller(client, x, sharding, 1) if via
                     else client.reshard(x, sharding, slice=1))
                y.block_until_ready()
                times[via].append(time.perf_counter() - t0)
                del y
        refs = statistics.median(times[False][1:])
        routed = statistics.median(times[True][1:])
        # The ratio within each back-to-back pair, then the median: this machine's speed
        # drifts between pairs more than within one.
        ratios = sorted(b / a for a, b in zip(times[False][1:], times[True][1:], strict=True))
        print(f"{args.mib} MiB over 4 chips, slice {client.slices[0].name} -> "
              f"{client.slices[1].name} (separate emulated hosts), median of {args.reps}")
        print(f"  chip to chip ({transfer_mode():<7}) {refs * 1e3:8.1f} ms  "
              f"{args.mib / refs:7.1f} MiB/s")
        print(f"  through the controller   {routed * 1e3:8.1f} ms  {args.mib / routed:7.1f} MiB/s")
        print(f"  ratio                    {statistics.median(ratios):8.2f}x (target >= 2x; "
              f"pairs {ratios[0]:.2f}-{ratios[-1]:.2f})")
        client.close()


if __name__ == "__main__":
    main()
