"""``pathways-ray``: start, inspect and stop TPU fleets.

    pathways-ray up --slices 2 --accelerator v6e --topology 2x4 --chips-per-host 4
    pathways-ray status
    pathways-ray down
    pathways-ray demo [--chaos]
    pathways-ray chaos kill-host v6e-2x4-1
    pathways-ray cache status|clear
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path

from rich.markup import escape

from pathways_ray._ui import make_console
from pathways_ray.clusters.topology import GENERATIONS, Topology
from pathways_ray.errors import PathwaysError

console = make_console()
err = make_console(stderr=True)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def _fleet_args(p: argparse.ArgumentParser, *, default_slices: int = 2,
                default_topology: str = "2x4") -> None:
    gens = ", ".join(GENERATIONS)
    p.add_argument("--slices", type=_positive_int, default=default_slices,
                   help=f"number of TPU slices to emulate (default {default_slices})")
    p.add_argument("--accelerator", default="v6e",
                   help=f"TPU generation: {gens}; or a pod type like v6e-16 (default v6e)")
    p.add_argument("--topology", default=None,
                   help=f"slice shape, e.g. 2x4, 4x4, 2x2x2 (default {default_topology}, or "
                   f"from the pod type)")
    p.set_defaults(default_topology=default_topology)
    p.add_argument("--chips-per-host", type=_positive_int, default=None,
                   help="override chips per host where GKE offers a choice (v5e/v6e 2x4: 8 or 4)")


def _topology(args) -> Topology:
    topology = args.topology
    if topology is None and not re.search(r"-[0-9]+$", args.accelerator.strip()):
        # a generation alone; a pod type such as v6e-16 implies its own shape
        topology = getattr(args, "default_topology", "2x4")
    return Topology.parse(args.accelerator, topology, chips_per_host=args.chips_per_host)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pathways-ray",
        description="A single-controller runtime for TPU fleets on Ray. Emulates a fleet of "
        "TPU hosts on this machine (one Ray node per host, one XLA CPU device per chip) or "
        "inspects a real one.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start a local emulated TPU fleet and leave it running",
                        description="Start a local Ray cluster that emulates TPU slices. "
                        "It keeps running until `pathways-ray down`.")
    _fleet_args(up)
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

    cache = sub.add_parser(
        "cache", help="show or clear the persistent compilation cache",
        description="The XLA executables chip workers keep between runs: `status` shows "
        "entries, size, and the hits and misses the chip workers counted from JAX's own "
        "monitoring events; `clear` removes every entry, so the next run compiles.")
    cache.add_argument("action", choices=["status", "clear"])
    cache.add_argument("--dir", default=None,
                       help="cache directory (default $PATHWAYS_RAY_COMPILATION_CACHE_DIR, "
                       "else <PATHWAYS_RAY_DIR>/xla-cache)")

    demo = sub.add_parser("demo", help="train a small LM through the single controller",
                          description="Start a local emulated fleet, train a small transformer "
                          "LM through the single controller (data parallel across slices, "
                          "data x model parallel within each), write a loss-curve PNG, print "
                          "the fleet status and a summary, and shut everything down.")
    _fleet_args(demo, default_topology="2x2")
    demo.add_argument("--steps", type=_positive_int, default=80, help="training steps (80)")
    demo.add_argument("--batch", type=_positive_int, default=64,
                      help="global batch, split over slices and their data axis (64)")
    demo.add_argument("--out", default="pathways-ray-demo", help="where loss.png goes")
    demo.add_argument("--chaos", action="store_true",
                      help="kill a host of the last slice a third of the way in and bring it "
                      "back two steps later: training carries on, then grows back")
    slurm = sub.add_parser(
        "slurm", help="write an sbatch script that runs a training script on Slurm nodes",
        description="Write an sbatch script: a Ray head on the allocation's first node, TPU "
        "hosts on every node (Ray detects the chips of a TPU VM; CPU nodes emulate them), "
        "the command as a Ray job, and everything stopped when the job ends or is "
        "cancelled. Example: pathways-ray slurm --nodes 2 --slices 2 --topology 2x2 -o "
        "train.sbatch -- python examples/train_jax_lm.py; then sbatch train.sbatch.")
    _fleet_args(slurm, default_slices=1, default_topology="2x2")
    slurm.add_argument("--nodes", type=_positive_int, default=1, help="Slurm nodes (1)")
    slurm.add_argument("--job-name", default="pathways-ray")
    slurm.add_argument("--time", default="01:00:00", help="time limit (01:00:00)")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--log", default=None,
                       help="sbatch --output (default: slurm-<job id>.out in the submit dir)")
    slurm.add_argument("--state-dir", default=None,
                       help="a directory every node sees, for the job's Ray token (default: "
                       "$SLURM_SUBMIT_DIR/.pathways-ray-slurm)")
    slurm.add_argument("--port", type=int, default=6379, help="Ray head port (6379)")
    slurm.add_argument("--dashboard-port", type=int, default=8265,
                       help="Ray dashboard and job API port (8265)")
    slurm.add_argument("-o", "--output", default=None,
                       help="write the script here (default: print it)")
    slurm.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                       help="after `--`: the training command, run from the submit directory")
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
    svc.add_argument("--address", default=None,
                     help="Ray cluster address (default: $RAY_ADDRESS, else the local fleet)")
    svc.add_argument("--fleet", default=None, help="local fleet name, when several are running")
    svc.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                     help="status: redraw every SECONDS until Ctrl-C")
    prof = sub.add_parser(
        "profile", help="run a command with one trace recorded across every chip",
        description="Run COMMAND (a script that calls pathways_ray.connect) with every client "
        "it connects profiled from connect() to close(): each chip worker records JAX's "
        "profiler, the controller and the client their dispatch spans, merged on one clock "
        "into DIR/plugins/profile/<run>/pathways.perfetto.json.gz (ui.perfetto.dev) "
        "and pathways.xplane.pb beside it (tensorboard --logdir DIR, or xprof DIR). "
        "Keep the run short: every event is held in memory until the client closes. "
        "In a script, "
        "`with client.profile(dir):` records one part of it.")
    prof.add_argument("--logdir", default=None,
                      help="where traces go (default <PATHWAYS_RAY_DIR>/profiles)")
    prof.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                      help="after `--`: the command to run")
    _add_plugins(sub)
    return parser


def _add_plugins(sub) -> None:
    """Commands of the optional parts (e.g. ``k8s`` from pathways_ray.kuberay).

    They register through the ``pathways_ray.transport.commands`` entry point group, so the
    core never imports them.
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group="pathways_ray.commands"):
        try:
            register = ep.load()
        except ImportError as e:  # an extra's dependency is missing
            logging.getLogger(__name__).debug("command %s unavailable: %s", ep.name, e)
            continue
        COMMANDS.update(register(sub))


def cmd_up(args) -> int:
    from pathways_ray._ui import fleet_progress
    from pathways_ray.emulation.local_fleet import LocalFleet
    from pathways_ray.observability.status import collect_status, render_status

    topo = _topology(args)
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


def _connect_for_status(args):
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


def cmd_status(args) -> int:
    from pathways_ray.observability.status import collect_status, render_status

    if args.watch is not None and args.watch <= 0:
        raise ValueError(f"--watch {args.watch:g}: give the seconds between redraws, e.g. 2")
    fleet = _connect_for_status(args)
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


def cmd_cache(args) -> int:
    from pathways_ray.config import default_compilation_cache_dir
    from pathways_ray.programs import compile_cache

    path = args.dir or default_compilation_cache_dir()
    if args.action == "clear":
        n = compile_cache.clear(path)
        console.print(f"removed {n} entries from {path}", highlight=False)
    else:
        console.print(compile_cache.summary(path).table(), highlight=False)
    return 0


def cmd_slurm(args) -> int:
    from pathways_ray.clusters.slurm import SlurmJob, render_sbatch

    command = list(args.job_command)
    if command[:1] == ["--"]:
        command = command[1:]
    job = SlurmJob(tuple(command), (_topology(args),) * args.slices, nodes=args.nodes,
                   job_name=args.job_name, time_limit=args.time, partition=args.partition,
                   output=args.log, state_dir=args.state_dir, port=args.port,
                   dashboard_port=args.dashboard_port)
    script = render_sbatch(job)
    if args.output is None:
        sys.stdout.write(script)
        return 0
    Path(args.output).write_text(script)
    Path(args.output).chmod(0o755)
    console.print(f"wrote {args.output}: {job.chips} chips on {job.nodes} node(s); submit it "
                  f"with `sbatch {args.output}`", highlight=False)
    return 0


CHAOS_ACTIONS = {"kill-host": "killed", "freeze-host": "froze", "thaw-host": "thawed",
                 "restore-host": "restored"}


def cmd_service(args) -> int:
    from pathways_ray.service.lease import render_status
    from pathways_ray.service.service import service

    if args.watch is not None and args.watch <= 0:
        raise ValueError(f"--watch {args.watch:g}: give the seconds between redraws, e.g. 2")
    fleet = _connect_for_status(argparse.Namespace(address=args.address, name=args.fleet))
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


def cmd_chaos(args) -> int:
    from pathways_ray.emulation.local_fleet import LocalFleet

    fleet = LocalFleet.running(args.name)
    fleet._plan(args.slice, args.worker)  # a ValueError naming the hosts there are
    match args.action:
        case "kill-host":
            fleet.remove_host(args.slice, args.worker)
        case "freeze-host" | "thaw-host":
            fleet.freeze_host(args.slice, args.worker, frozen=args.action == "freeze-host")
        case "restore-host":
            fleet.restore_host(args.slice, args.worker)
    console.print(f"{CHAOS_ACTIONS[args.action]} host {args.slice}/{args.worker} of fleet "
                  f"{fleet.name!r}")
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
    for name in names:
        n = stop_local_fleet(name)
        console.print(f"stopped fleet {name!r} ({n} processes)")
    return 0


def cmd_demo(args) -> int:
    from pathways_ray.demo import run_demo

    topo = _topology(args)
    run_demo(num_slices=args.slices, accelerator=topo.generation.name, topology=topo.name,
             chips_per_host=topo.chips_per_host, steps=args.steps, batch=args.batch,
             out_dir=args.out, console=console, chaos=args.chaos)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwinding as Ctrl-C does."""


def handle_sigterm_as_interrupt() -> None:
    """Kubernetes, Docker and systemd stop a process with SIGTERM: unwind as on Ctrl-C
    (``KeyboardInterrupt``), so every command stops what it started.

    A signal handler's exception is lost when the signal lands inside a gc callback or
    a ``__del__`` (JAX has a gc callback; seen here: SIGTERM mid-training was
    "ignored" and the demo ran on). Python reports such a lost exception to
    ``sys.unraisablehook``; ours has it raised again in the main thread a moment later
    (from another thread: raised from the hook itself, it would be lost the same way).

    A signal that lands while a module is being imported waits until the import is
    done: raised there, it can cross a native extension's init (jaxlib's nanobind
    turns it into a C++ exception nobody catches, and the process aborts; seen in CI
    with SIGTERM during ``import jax``). Ctrl-C gets the same treatment.
    """
    import threading

    main_thread = threading.main_thread().ident

    def later(signum):  # a real signal to the main thread wakes it from a blocking call
        threading.Timer(0.05, signal.pthread_kill, args=(main_thread, signum)).start()

    def importing(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                return True
            frame = frame.f_back
        return False

    def on_signal(signum, frame):
        if importing(frame):
            later(signum)
            return
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            later(signal.SIGTERM if isinstance(unraisable.exc_value, Terminated)
                  else signal.SIGINT)
            return
        previous(unraisable)

    sys.unraisablehook = hook
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def cmd_profile(args) -> int:
    import subprocess

    from pathways_ray.config import base_dir
    from pathways_ray.observability.profiling import PROFILE_ENV

    command = list(args.job_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("no command to profile: pathways-ray profile [--logdir DIR] -- "
                         "python train.py")
    log_dir = os.path.abspath(args.logdir or base_dir() / "profiles")
    before = set(_traces(log_dir))
    rc = subprocess.call(command, env={**os.environ, PROFILE_ENV: log_dir})
    written = [p for p in _traces(log_dir) if p not in before]
    if written:
        console.print(f"traces written under {log_dir}:")
        for path in written:
            console.print(f"  {path} (tensorboard/xprof)")
            chrome = path.replace(".xplane.pb", ".perfetto.json.gz")
            console.print(f"  {chrome} (ui.perfetto.dev)")
        console.print(f"view: tensorboard --logdir {log_dir}")
    else:
        err.print(f"[yellow]no trace was written under {log_dir}[/yellow]: did the command "
                  f"call pathways_ray.connect() and close its client?")
    return rc


def _traces(log_dir: str) -> list[str]:
    import glob

    return sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb")))


COMMANDS = {"up": cmd_up, "status": cmd_status, "down": cmd_down, "demo": cmd_demo,
            "service": cmd_service, "profile": cmd_profile,
            "chaos": cmd_chaos, "cache": cmd_cache, "slurm": cmd_slurm}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handle_sigterm_as_interrupt()
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:
        parser.error(str(e))  # exits 2 with usage
    except PathwaysError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        return 1
    except KeyboardInterrupt:
        err.print("interrupted; stopped what was started")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
