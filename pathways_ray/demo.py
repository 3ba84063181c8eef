"""The main job on a local emulated fleet.

Starts a fleet of TPU slices, reserves every slice, proves each slice is one
JAX world with a real all-reduce, prints the status table and shuts down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from rich.console import Console

from pathways_ray._ui import fleet_progress
from pathways_ray.fleet import LocalFleet
from pathways_ray.slice import Slice
from pathways_ray.status import collect_status, render_status
from pathways_ray.topology import Topology


@dataclass(frozen=True)
class DemoResult:
    fleet_up_s: float
    reserve_s: dict[str, float]
    all_reduce: dict[str, float]  # slice -> the sum every chip got
    expected: dict[str, float]


def run_demo(
    *,
    num_slices: int = 2,
    accelerator: str = "v6e",
    topology: str = "2x4",
    chips_per_host: int | None = 4,
    console: Console | None = None,
) -> DemoResult:
    console = console or Console()
    topo = Topology.parse(accelerator, topology, chips_per_host=chips_per_host)
    console.print(f"[bold]pathways-ray[/bold]: emulating {num_slices} x {topo.describe()}")
    t0 = time.monotonic()
    fleet = LocalFleet(num_slices=num_slices, accelerator=accelerator, topology=topology,
                       chips_per_host=chips_per_host, name="demo")
    try:
        with fleet_progress(console) as update:
            fleet.start(progress=update)
        fleet_up = time.monotonic() - t0
        console.print(f"fleet up in {fleet_up:.1f}s at {fleet.address}")
        slices, reserve_s = [], {}
        try:
            for _ in range(num_slices):
                t1 = time.monotonic()
                s = Slice.reserve(topo, timeout_s=120)
                reserve_s[s.name] = time.monotonic() - t1
                slices.append(s)
                console.print(
                    f"reserved {s.name}: {s.num_chips} chip workers, one JAX world "
                    f"({s.world[0]['platform']} devices) in {reserve_s[s.name]:.1f}s"
                )
            sums, expected = {}, {}
            for s in slices:
                values = [np.float32(r + 1) for r in range(s.num_chips)]
                got = s.all_reduce(values)
                want = float(sum(values))
                if not all(np.allclose(g, want) for g in got):
                    raise RuntimeError(f"all-reduce on {s.name} returned {got}, want {want}")
                sums[s.name], expected[s.name] = float(got[0]), want
                console.print(
                    f"all-reduce on {s.name}: every chip got {float(got[0]):g} "
                    f"(= 1 + 2 + … + {s.num_chips})"
                )
            console.print(render_status(*collect_status()))
        finally:
            for s in slices:
                s.shutdown()
    finally:
        fleet.shutdown()
    console.print(f"done in {time.monotonic() - t0:.1f}s; every process stopped")
    return DemoResult(fleet_up, reserve_s, sums, expected)
