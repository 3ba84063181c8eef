"""What every command group shares: the consoles, argument types, the fleet flags and
connecting to the cluster a command inspects."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from pathways_ray._ui import make_console
from pathways_ray.clusters.topology import GENERATIONS, Topology
from pathways_ray.errors import PathwaysError

__all__ = ["cluster_flags", "connect_for_status", "console", "err", "fleet_args", "positive_int",
           "topology_of"]

console = make_console()
err = make_console(stderr=True)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def fleet_args(p: argparse.ArgumentParser, *, default_slices: int = 2,
                default_topology: str = "2x4") -> None:
    gens = ", ".join(GENERATIONS)
    p.add_argument("--slices", type=positive_int, default=default_slices,
                   help=f"number of TPU slices to emulate (default {default_slices})")
    p.add_argument("--accelerator", default="v6e",
                   help=f"TPU generation: {gens}; or a pod type like v6e-16 (default v6e)")
    p.add_argument("--topology", default=None,
                   help=f"slice shape, e.g. 2x4, 4x4, 2x2x2 (default {default_topology}, or "
                   f"from the pod type)")
    p.set_defaults(default_topology=default_topology)
    p.add_argument("--chips-per-host", type=positive_int, default=None,
                   help="override chips per host where GKE offers a choice (v5e/v6e 2x4: 8 or 4)")


def topology_of(args) -> Topology:
    topology = args.topology
    if topology is None and not re.search(r"-[0-9]+$", args.accelerator.strip()):
        # a generation alone; a pod type such as v6e-16 implies its own shape
        topology = getattr(args, "default_topology", "2x4")
    return Topology.parse(args.accelerator, topology, chips_per_host=args.chips_per_host)


def cluster_flags(p: argparse.ArgumentParser) -> None:
    """``--address`` and ``--fleet``: which cluster a command whose ``--name`` names
    something else reaches (``connect_for_status(args, name=args.fleet)``)."""
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else the local fleet)")
    p.add_argument("--fleet", default=None,
                   help="the local fleet (its `pathways-ray up --name`), when several are "
                   "running")


def connect_for_status(args):
    """Connect to --address, $RAY_ADDRESS, or the running local fleet."""
    from pathways_ray import _auth
    from pathways_ray.clusters.fleet import Fleet
    from pathways_ray.emulation.local_fleet import running_fleets

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address is None:
        fleets = running_fleets()
        if args.name:
            fleets = [f for f in fleets if f.name == args.name]
        if not fleets:
            raise PathwaysError(
                "no cluster to inspect: no local fleet is running (start one with "
                "`pathways-ray up`) and neither --address nor $RAY_ADDRESS is set"
            )
        if len(fleets) > 1:
            raise PathwaysError(
                "several local fleets are running ("
                + ", ".join(f.name for f in fleets) + "); pick one with --name"
            )
        address = fleets[0].address
        _auth.use_token(Path(fleets[0].token_path))
    return Fleet.attach(address)
