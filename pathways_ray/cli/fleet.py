"""Commands for a fleet: ``up``, ``status``, ``chaos`` and ``down``."""

from __future__ import annotations

from pathways_ray.cli.common import connect_for_status, console, err, fleet_args, topology_of
from pathways_ray.errors import PathwaysError

CHAOS_ACTIONS = {"kill-host": "killed", "freeze-host": "froze", "thaw-host": "thawed",
                 "restore-host": "restored"}


def register(sub) -> dict:
    """Add this group's commands to ``sub``; returns their handlers."""
    up = sub.add_parser("up", help="start a local emulated TPU fleet and leave it running",
                        description="Start a local Ray cluster that emulates TPU slices. "
                        "It keeps running until `pathways-ray down`.")
    fleet_args(up)
    up.add_argument("--name", default="local", help="fleet name (default local)")
    up.add_argument("--dashboard", action="store_true",
                    help="start the Ray dashboard (needed for `ray job submit`)")

    st = sub.add_parser("status", help="show slices, hosts, chips and worker health",
                        description="Show the TPU slices of a running cluster: every host, its "
                        "chips in use, and the health of chip workers of reserved slices.")
    st.add_argument("--address", default=None,
                    help="Ray cluster address (default: $RAY_ADDRESS, else the local fleet)")
    st.add_argument("--name", default=None, help="local fleet name, when several are running")
    st.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                    help="redraw the table every SECONDS until Ctrl-C (host and worker "
                    "health, live)")

    chaos = sub.add_parser(
        "chaos", help="kill, freeze, thaw or restore an emulated TPU host (fault injection)",
        description="Inject a failure into a running local fleet, for real: kill-host "
        "SIGKILLs every process of one emulated TPU host (a lost VM), freeze-host SIGSTOPs "
        "them (a hung VM), thaw-host SIGCONTs them, restore-host starts a fresh host in "
        "place of a killed one (a replacement VM).")
    chaos.add_argument("action", choices=list(CHAOS_ACTIONS))
    chaos.add_argument("slice", help="slice name, as `pathways-ray status` shows it")
    chaos.add_argument("--worker", type=int, default=0,
                       help="the host's TPU worker id within its slice (default 0)")
    chaos.add_argument("--name", default=None, help="local fleet name, when several are running")

    down = sub.add_parser("down", help="stop a local emulated fleet")
    down.add_argument("--name", default=None, help="fleet name (default: the only one running)")
    down.add_argument("--all", action="store_true", help="stop every local fleet")

    return {"up": cmd_up, "status": cmd_status, "chaos": cmd_chaos, "down": cmd_down}


def cmd_up(args) -> int:
    from pathways_ray._ui import fleet_progress
    from pathways_ray.emulation.local_fleet import LocalFleet
    from pathways_ray.observability.status import collect_status, render_status

    topo = topology_of(args)
    fleet = LocalFleet(num_slices=args.slices, accelerator=topo.generation.name,
                       topology=topo.name, chips_per_host=topo.chips_per_host,
                       name=args.name, dashboard=args.dashboard, detach=True)
    err.print(f"starting {args.slices} x {topo.describe()} as fleet {args.name!r}")
    try:
        with fleet_progress(err) as update:
            fleet.start(progress=update)
    except BaseException:
        fleet.shutdown()
        raise
    console.print(render_status(*collect_status()))
    console.print("\nConnect from another shell:")
    for key, value in fleet.env.items():
        console.print(f"  export {key}={value}", soft_wrap=True, highlight=False)
    if fleet.dashboard_url:
        console.print(f"  # dashboard: {fleet.dashboard_url}  (ray job submit --address "
                      f"{fleet.dashboard_url} ...)", soft_wrap=True, highlight=False)
    console.print(f"Stop it with: pathways-ray down --name {args.name}")
    return 0


def cmd_status(args) -> int:
    from pathways_ray.observability.status import collect_status, render_status

    if args.watch is not None and args.watch <= 0:
        raise ValueError(f"--watch {args.watch:g}: give the seconds between redraws, e.g. 2")
    fleet = connect_for_status(args)
    try:
        if args.watch is None:
            console.print(render_status(*collect_status()))
            return 0
        import time

        from rich.live import Live

        with Live(render_status(*collect_status()), console=console,
                  auto_refresh=False) as live:
            while True:
                time.sleep(args.watch)
                live.update(render_status(*collect_status()), refresh=True)
    finally:
        fleet.shutdown()


def cmd_chaos(args) -> int:
    from pathways_ray.emulation.local_fleet import LocalFleet

    fleet = LocalFleet.running(args.name)
    fleet._plan(args.slice, args.worker)  # a ValueError naming the fleet and its hosts
    processes = len(fleet.host_processes(args.slice, args.worker))
    match args.action:
        case "kill-host":
            fleet.remove_host(args.slice, args.worker)
        case "freeze-host" | "thaw-host":
            fleet.freeze_host(args.slice, args.worker, frozen=args.action == "freeze-host")
        case "restore-host":
            fleet.restore_host(args.slice, args.worker)
            processes = len(fleet.host_processes(args.slice, args.worker))
    console.print(f"{CHAOS_ACTIONS[args.action]} host {args.slice}/{args.worker} of fleet "
                  f"{fleet.name!r} ({fleet.fleet_id}, {processes} processes); no other "
                  f"fleet was touched")
    return 0


def cmd_down(args) -> int:
    from pathways_ray.emulation.local_fleet import running_fleets, stop_local_fleet

    running = running_fleets()
    if args.all:
        names = [f.name for f in running]
    elif args.name:
        names = [args.name]
    elif len(running) == 1:
        names = [running[0].name]
    elif not running:
        console.print("no local fleet is running")
        return 0
    else:
        raise PathwaysError(
            "several local fleets are running (" + ", ".join(f.name for f in running)
            + "); pick one with --name or stop them all with --all"
        )
    ids = {f.name: f.fleet_id for f in running}
    for name in names:
        n = stop_local_fleet(name)
        console.print(f"stopped fleet {name!r} ({ids.get(name, 'not running')}, {n} "
                      f"processes)")
    return 0
