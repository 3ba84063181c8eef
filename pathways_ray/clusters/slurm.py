"""An ``sbatch`` script that runs a training script as a Ray job on a Slurm allocation.

``pathways-ray slurm --nodes 2 --slices 2 --topology 2x2 -- python train.py`` writes
it. Cloud Pathways reaches Slurm through Cluster Director; this is the open way.
What the job does, in order:

1. makes a Ray token for this job only (``RAY_AUTH_TOKEN_PATH``, in a directory
   every node sees: ``--state-dir``, default under ``$SLURM_SUBMIT_DIR``);
2. starts the Ray head on the first node (an ``srun`` step);
3. starts the TPU hosts on every node (one ``srun`` step over all of them,
   ``pathways_ray.clusters.slurm_node``): on a TPU VM one Ray node that detects its chips
   itself; on a CPU node the emulated TPU hosts given to that node (our fleet's
   resources, labels and env vars), the hosts of all slices dealt out to the
   nodes in turn;
4. waits until the cluster has every chip, then ``ray job submit``s the command
   from the submit directory and waits for it;
5. when the job ends, fails or is cancelled (``scancel`` sends SIGTERM), stops
   both steps: each node stops its Ray processes, and the token is removed.

Pure: nothing here imports Ray.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field

from pathways_ray.clusters.topology import Topology

__all__ = ["SlurmJob", "render_sbatch"]

_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


@dataclass(frozen=True)
class SlurmJob:
    """What to run, on how many nodes, with which (emulated or real) TPU slices."""

    command: tuple[str, ...]
    slices: tuple[Topology, ...]
    nodes: int = 1
    job_name: str = "pathways-ray"
    time_limit: str = "01:00:00"
    partition: str | None = None
    output: str | None = None  # sbatch --output (default: slurm-<job id>.out)
    state_dir: str | None = None  # shared by the nodes; default $SLURM_SUBMIT_DIR/...
    python: str = field(default_factory=lambda: sys.executable)
    port: int = 6379
    dashboard_port: int = 8265
    start_timeout_s: int = 300

    def __post_init__(self):
        if not self.command:
            raise ValueError("command=() is empty: give the training command after `--`, "
                             "e.g. `-- python examples/train_jax_lm.py`")
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes} must be 1 or more")
        if not self.slices:
            raise ValueError("slices=() is empty: give at least one slice")
        hosts = sum(t.num_hosts for t in self.slices)
        if self.nodes > hosts:
            raise ValueError(f"nodes={self.nodes} is more than the {hosts} TPU hosts of the "
                             f"slices; use --nodes {hosts} or fewer (a node runs one or more "
                             f"hosts)")
        if not _TIME_RE.match(self.time_limit):
            raise ValueError(f"time_limit={self.time_limit!r} is not a Slurm time; use e.g. "
                             f"'30:00', '02:00:00' or '1-00:00:00'")
        if not re.match(r"^[A-Za-z0-9._-]+$", self.job_name):
            raise ValueError(f"job_name={self.job_name!r}: use letters, digits, '.', '_', '-'")
        for name in ("port", "dashboard_port"):
            if not 1024 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}={getattr(self, name)} is not a port in 1024..65535")

    @property
    def chips(self) -> int:
        return sum(t.chips for t in self.slices)

    @property
    def slices_arg(self) -> str:
        """The slices as ``slurm_node`` reads them: ``<topology>@<chips per host>,...``."""
        return ",".join(f"{t}@{t.chips_per_host}" for t in self.slices)


def render_sbatch(job: SlurmJob) -> str:
    q = shlex.quote
    node = f"{q(job.python)} -m pathways_ray.clusters.slurm_node"
    directives = [f"--job-name={job.job_name}", f"--nodes={job.nodes}",
                  "--ntasks-per-node=1", f"--time={job.time_limit}"]
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.output:
        directives.append(f"--output={job.output}")
    state = q(job.state_dir) if job.state_dir else '"$SLURM_SUBMIT_DIR/.pathways-ray-slurm"'
    slices = ", ".join(t.describe() for t in job.slices)
    return f"""#!/bin/bash
# Written by `pathways-ray slurm`: {len(job.slices)} TPU slice(s) ({slices}), {job.chips} chips
# on {job.nodes} node(s); runs as a Ray job: {shlex.join(job.command)}
{chr(10).join(f"#SBATCH {d}" for d in directives)}
set -uo pipefail

STATE={state}/"$SLURM_JOB_ID"
mkdir -p "$STATE"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$STATE/token" RAY_USAGE_STATS_ENABLED=0
export PATHWAYS_RAY_FLEET="slurm-$SLURM_JOB_ID"
unset RAY_ADDRESS RAY_AUTH_TOKEN
{node} token "$RAY_AUTH_TOKEN_PATH" || exit 1
HEAD_IP=$({node} ip) || exit 1
ADDRESS="$HEAD_IP:{job.port}"
STEPS=""

stop() {{
  trap - EXIT TERM INT
  echo "pathways-ray: stopping Ray on every node" >&2
  # SIGTERM to the steps' tasks (srun itself, sent SIGTERM, would SIGKILL them): each
  # node stops its Ray processes, Ray workers included; then the sruns return.
  scancel --signal=TERM "$SLURM_JOB_ID.0" "$SLURM_JOB_ID.1" 2>/dev/null
  [ -n "$STEPS" ] && wait $STEPS 2>/dev/null
  rm -rf "$STATE"
  rmdir "$(dirname "$STATE")" 2>/dev/null || true
}}
trap stop EXIT
trap 'echo "pathways-ray: job cancelled" >&2; exit 143' TERM INT

NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
srun --overlap --nodes=1 --ntasks=1 -w "${{NODES[0]}}" \\
  {node} head --port {job.port} --dashboard-port {job.dashboard_port} &
STEPS="$STEPS $!"
{node} wait --address "$ADDRESS" --chips 0 --timeout {job.start_timeout_s} || exit 1
srun --overlap --nodes={job.nodes} --ntasks-per-node=1 \\
  {node} hosts --address "$ADDRESS" --slices {q(job.slices_arg)} --nodes {job.nodes} &
STEPS="$STEPS $!"
{node} wait --address "$ADDRESS" --chips {job.chips} --timeout {job.start_timeout_s} || exit 1

cd "$SLURM_SUBMIT_DIR"
"$(dirname {q(job.python)})/ray" job submit --address "http://$HEAD_IP:{job.dashboard_port}" \\
  --working-dir . -- {shlex.join(job.command)} &
wait $!
"""
