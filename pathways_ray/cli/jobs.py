"""Commands that run work: ``demo``, ``slurm`` (an sbatch script) and ``profile``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pathways_ray.cli.common import console, err, fleet_args, positive_int, topology_of


def register(sub) -> dict:
    """Add this group's commands to ``sub``; returns their handlers."""
    demo = sub.add_parser("demo", help="train a small LM through the single controller",
                          description="Start a local emulated fleet, train a small transformer "
                          "LM through the single controller (data parallel across slices, "
                          "data x model parallel within each), write a loss-curve PNG, print "
                          "the fleet status and a summary, and shut everything down.")
    fleet_args(demo, default_topology="2x2")
    demo.add_argument("--steps", type=positive_int, default=80, help="training steps (80)")
    demo.add_argument("--batch", type=positive_int, default=64,
                      help="global batch, split over slices and their data axis (64)")
    demo.add_argument("--microbatches", type=positive_int, default=1,
                      help="micro-batches per slice and step, accumulated (1)")
    demo.add_argument("--bf16", action="store_true",
                      help="compute in bfloat16, keep float32 master weights")
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
    fleet_args(slurm, default_slices=1, default_topology="2x2")
    slurm.add_argument("--nodes", type=positive_int, default=1, help="Slurm nodes (1)")
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
    return {"demo": cmd_demo, "slurm": cmd_slurm, "profile": cmd_profile}


def cmd_demo(args) -> int:
    from pathways_ray.demo import run_demo

    topo = topology_of(args)
    run_demo(num_slices=args.slices, accelerator=topo.generation.name, topology=topo.name,
             chips_per_host=topo.chips_per_host, steps=args.steps, batch=args.batch,
             out_dir=args.out, console=console, chaos=args.chaos,
             microbatches=args.microbatches, bf16=args.bf16)
    return 0


def cmd_slurm(args) -> int:
    from pathways_ray.clusters.slurm import SlurmJob, render_sbatch

    command = list(args.job_command)
    if command[:1] == ["--"]:
        command = command[1:]
    job = SlurmJob(tuple(command), (topology_of(args),) * args.slices, nodes=args.nodes,
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
