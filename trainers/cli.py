"""The command line every training example shares: where to run, on which slices.

    ap = argparse.ArgumentParser()
    add_slice_args(ap, topology="2x4", slices=1, name="torch-ddp")
    args = ap.parse_args()
    topo = slice_topology(args)
    fleet_name = "t" + re.sub(r"[^a-z0-9-]", "-", args.name.lower())[:19]  # a valid fleet name
    with cluster_or_local(args.address, slices=[topo] * args.slices, name=fleet_name):
        ...
"""

from __future__ import annotations

import argparse
import re

from pathways_ray.clusters.topology import Topology
from pathways_ray.config import base_dir

__all__ = ["add_slice_args", "fit_on_slices", "slice_topology"]


def add_slice_args(ap: argparse.ArgumentParser, *, topology: str, slices: int, name: str,
                   steps: int = 30, report_every: int = 10) -> None:
    ap.add_argument("--address", help="Ray cluster (default: $RAY_ADDRESS, as under "
                    "`ray job submit`; else a local emulated fleet)")
    ap.add_argument("--accelerator", default="v6e", help="TPU generation (default: v6e)")
    ap.add_argument("--topology", default=topology, help=f"slice shape (default: {topology})")
    ap.add_argument("--chips-per-host", type=int,
                    help="host size where GKE offers two (v5e/v6e 2x4: 8 or 4)")
    ap.add_argument("--slices", type=int, default=slices, help=f"(default: {slices})")
    ap.add_argument("--steps", type=int, default=steps, help=f"(default: {steps})")
    ap.add_argument("--report-every", type=int, default=report_every,
                    help=f"steps between reports and checkpoints (default: {report_every})")
    ap.add_argument("--storage-path", default=str(base_dir() / "runs"),
                    help="where Ray Train keeps checkpoints (shared storage on a cluster)")
    ap.add_argument("--name", default=name, help=f"run name; a rerun with the same name "
                    f"resumes from its last checkpoint (default: {name})")


def slice_topology(args: argparse.Namespace) -> Topology:
    if args.slices < 1:
        raise SystemExit(f"--slices={args.slices} must be at least 1")
    try:
        return Topology.parse(args.accelerator, args.topology,
                              chips_per_host=args.chips_per_host)
    except ValueError as e:
        raise SystemExit(f"--accelerator/--topology/--chips-per-host: {e}") from None


def fit_on_slices(trainer_cls, train_loop, config: dict, args: argparse.Namespace,
                  **trainer_kwargs):
    """Run ``trainer_cls`` with one worker per chip of ``args.slices`` slices and return
    its ``Result``; on the cluster of ``--address`` / ``$RAY_ADDRESS``, else on a local
    emulated fleet of those slices (stopped afterwards). What it builds::

        trainer_cls(train_loop, train_loop_config=config,
                    scaling_config=ScalingConfig(use_tpu=True, accelerator_type="TPU-V6E",
                        topology="2x4", num_workers=8, resources_per_worker={"TPU": 1}),
                    run_config=RunConfig(name=..., storage_path=...,
                        checkpoint_config=CheckpointConfig(num_to_keep=2)))
    """
    from pathways_ray.emulation.local_fleet import cluster_or_local
    from pathways_ray.trainers import CheckpointConfig, RunConfig, ScalingConfig

    topo = slice_topology(args)
    fleet_name = "t" + re.sub(r"[^a-z0-9-]", "-", args.name.lower())[:19]  # a valid fleet name
    with cluster_or_local(args.address, slices=[topo] * args.slices, name=fleet_name):
        trainer = trainer_cls(
            train_loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(
                use_tpu=True, accelerator_type=topo.accelerator_type, topology=topo.name,
                chips_per_host=topo.chips_per_host, num_workers=topo.chips * args.slices,
                resources_per_worker={"TPU": 1}),
            run_config=RunConfig(name=args.name, storage_path=args.storage_path,
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
            **trainer_kwargs,
        )
        return trainer.fit()
