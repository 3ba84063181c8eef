"""``pathways-ray service``: a shared pool of slices that many clients lease from."""

from __future__ import annotations

import argparse

from pathways_ray.cli.common import cluster_flags, connect_for_status, console, err
from pathways_ray.clusters.topology import Topology


def register(sub) -> dict:
    """Add this group's commands to ``sub``; returns their handlers."""
    svc = sub.add_parser(
        "service", help="a shared pool of slices that many clients lease from",
        description="start: run a long-lived service (a detached Ray actor) that holds a pool "
        "of slices; clients lease them with pathways_ray.connect(service=NAME, "
        "slices={'v6e-2x2': 1}), wait in its queue when they are busy, and give them back on "
        "close, on exit, or when their heartbeats stop ($PATHWAYS_RAY_HEARTBEAT_TIMEOUT_S, "
        "default 30 s). status: users, leases, the queue and capacity. stop: end every lease "
        "and release every slice.")
    svc.add_argument("action", choices=["start", "status", "stop"])
    svc.add_argument("--name", default="default", help="service name (default: default)")
    svc.add_argument("--slices", default=None, metavar="SHAPES",
                     help="the pool, comma-separated (e.g. v6e-2x2,v6e-2x2; default: every "
                     "free slice of the cluster)")
    cluster_flags(svc)
    svc.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                     help="status: redraw every SECONDS until Ctrl-C")
    return {"service": cmd_service}


def cmd_service(args) -> int:
    from pathways_ray.service import control as service
    from pathways_ray.service.lease import render_status

    if args.watch is not None and args.watch <= 0:
        raise ValueError(f"--watch {args.watch:g}: give the seconds between redraws, e.g. 2")
    fleet = connect_for_status(argparse.Namespace(address=args.address, name=args.fleet))
    try:
        if args.action == "start":
            slices = None
            if args.slices:
                slices = [str(Topology.of(s.strip())) for s in args.slices.split(",") if s.strip()]
            err.print(f"starting service {args.name!r} ...")
            status = service.start_service(args.name, slices)
            console.print(render_status(args.name, status))
            shape = status["slices"][0]["shape"]
            console.print(f"\nLease from it: pathways_ray.connect(service={args.name!r}, "
                          f"slices={{{shape!r}: 1}})\nStop it: pathways-ray service stop "
                          f"--name {args.name}", highlight=False)
        elif args.action == "stop":
            out = service.stop_service(args.name)
            console.print(f"stopped service {args.name!r}: released {len(out['slices'])} slices, "
                          f"ended {len(out['leases'])} leases and {len(out['requests'])} waiting "
                          f"requests", highlight=False)
        elif args.watch is None:
            console.print(render_status(args.name, service.service_status(args.name)))
        else:
            import time

            from rich.live import Live

            def draw():
                return render_status(args.name, service.service_status(args.name))

            with Live(draw(), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(args.watch)
                    live.update(draw(), refresh=True)
        return 0
    finally:
        fleet.shutdown()
