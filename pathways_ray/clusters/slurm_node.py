"""What a Slurm node runs for a ``pathways-ray slurm`` job (see ``pathways_ray.clusters.slurm``).

    python -m pathways_ray.clusters.slurm_node token PATH         # a fresh Ray token (0600)
    python -m pathways_ray.clusters.slurm_node ip                 # this node's IP, as Ray sees it
    python -m pathways_ray.clusters.slurm_node head --port P --dashboard-port D
    python -m pathways_ray.clusters.slurm_node hosts --address A --slices 2x2@4,2x2@4 --nodes N
    python -m pathways_ray.clusters.slurm_node wait --address A --chips C --timeout S

``head`` and ``hosts`` run ``ray start --block`` processes (each the leader of a
session, tagged ``PATHWAYS_RAY_FLEET``) and stay in the foreground until SIGTERM
(``scancel``, or the batch script ending), then stop every process they started,
Ray workers included. ``hosts`` on a TPU VM starts one Ray node that detects its
chips; on a CPU node it starts this node's share of emulated TPU hosts
(``$SLURM_NODEID``-th of every ``--nodes``, over the hosts of all slices).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pathways_ray import _auth, _procs
from pathways_ray._procs import free_ports
from pathways_ray.clusters.host_plan import (
    HEAD_SYSTEM_CONFIG,
    NODE_ENV,
    plan_hosts,
    ray_start_command,
)
from pathways_ray.clusters.topology import Topology


def parse_slices(text: str) -> list[Topology]:
    """``<generation>-<shape>@<chips per host>`` items (``v6e-2x2@4``), comma-separated."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        spec, _, per_host = item.partition("@")
        out.append(Topology.of(spec, chips_per_host=int(per_host) if per_host else None))
    if not out:
        raise ValueError(f"--slices={text!r} names no slice")
    return out


def node_has_tpus() -> bool:
    from pathways_ray.clusters.host_plan import detect_platform

    return detect_platform() == "tpu"


# Processes this helper started carry this tag (not the job's: on a shared node the
# other helper's processes, and the batch script itself, must not match).
_TAG = f"{os.environ.get(_procs.FLEET_ENV, 'slurm')}-{os.getpid()}"


def _spawn(args: list[str], env: dict[str, str | None], tag: str,
           object_store_mb: int) -> subprocess.Popen:
    """``ray start ... --block`` as the leader of a new session; ``None`` in ``env``
    removes a variable."""
    temp = Path(tempfile.mkdtemp(prefix=f"pwr-{tag}-"))
    cmd = ray_start_command(temp, object_store_mb, free_ports(4), [*args, "--block"])
    full_env = {**NODE_ENV, **os.environ, **env, _procs.FLEET_ENV: _TAG}
    for key in ("RAY_ADDRESS", *(k for k, v in env.items() if v is None)):
        full_env.pop(key, None)
    proc = subprocess.Popen(cmd, env=full_env, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    proc.temp_dir = temp  # Ray's session logs: removed by _serve after a clean stop
    return proc


def _serve(procs: list[subprocess.Popen]) -> int:
    """Stay up until SIGTERM/SIGINT or until a ``ray start`` exits; then stop all."""
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rc = 0
    while stop["sig"] is None:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            print(f"pathways-ray: `ray start` {dead[0].pid} exited with {dead[0].returncode}",
                  file=sys.stderr, flush=True)
            rc = 1
            break
        time.sleep(0.5)
    _procs.kill_all(_TAG, [p.pid for p in procs], grace_s=5.0)
    for p in procs:  # Ray's temp dirs (session logs): kept only for a post-mortem
        if rc:
            print(f"pathways-ray: Ray's logs of `ray start` {p.pid} are kept in {p.temp_dir}",
                  file=sys.stderr, flush=True)
        else:
            shutil.rmtree(p.temp_dir, ignore_errors=True)
    return rc


def cmd_head(args) -> int:
    ray_args = ["--head", f"--port={args.port}", "--num-cpus=2",  # the job's driver side
                f"--system-config={json.dumps(HEAD_SYSTEM_CONFIG)}",
                "--include-dashboard=true", "--dashboard-host=0.0.0.0",
                f"--dashboard-port={args.dashboard_port}"]
    env = dict.fromkeys(("TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY",
                         "TPU_WORKER_HOSTNAMES"))  # the head is not a TPU host
    return _serve([_spawn(ray_args, env, "head", args.object_store_mb)])


def cmd_hosts(args) -> int:
    if node_has_tpus():  # a TPU VM: Ray reads its chips, name and worker id itself
        return _serve([_spawn([f"--address={args.address}"], {}, "tpu", args.object_store_mb)])
    index = int(os.environ.get("SLURM_NODEID", args.node_index))
    # Two CPUs a chip, as a local fleet's hosts, and two more: TPU hosts have plenty, and
    # a job's own actors (Ray Train's workers) must not take what a slice reserves.
    slices = parse_slices(args.slices)
    plans = plan_hosts(slices, max(4, 2 * max(t.chips_per_host for t in slices) + 2))
    plans = plans[index::args.nodes]
    procs = []
    for plan in plans:
        env = {**plan.env, _procs.HOST_ENV: plan.key}
        procs.append(_spawn(plan.start_args(args.address), env, plan.key.replace("/", "-"),
                            args.object_store_mb))
        print(f"pathways-ray: emulated TPU host {plan.key} on node {index}", flush=True)
    return _serve(procs)


def cmd_wait(args) -> int:
    """Until the cluster answers and has ``--chips`` TPU chips, or ``--timeout``."""
    import ray

    deadline, last = time.monotonic() + args.timeout, "no answer"
    while time.monotonic() < deadline:
        try:
            if not ray.is_initialized():
                ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
            chips = int(ray.cluster_resources().get("TPU", 0))
            if chips >= args.chips:
                ray.shutdown()
                return 0
            last = f"{chips} of {args.chips} chips"
        except Exception as e:  # noqa: BLE001 - not up yet; said at the deadline
            last = f"{type(e).__name__}: {e}"
            ray.shutdown()
        time.sleep(1.0)
    print(f"pathways-ray: the Ray cluster at {args.address} did not have {args.chips} TPU chips "
          f"within --timeout {args.timeout:g} s ({last})", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pathways_ray.clusters.slurm_node",
                                 description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tok = sub.add_parser("token")
    tok.add_argument("path")
    sub.add_parser("ip")
    head = sub.add_parser("head")
    head.add_argument("--port", type=int, required=True)
    head.add_argument("--dashboard-port", type=int, required=True)
    hosts = sub.add_parser("hosts")
    hosts.add_argument("--address", required=True)
    hosts.add_argument("--slices", required=True)
    hosts.add_argument("--nodes", type=int, default=1)
    hosts.add_argument("--node-index", type=int, default=0)
    for p in (head, hosts):
        p.add_argument("--object-store-mb", type=int, default=512)
    wait = sub.add_parser("wait")
    wait.add_argument("--address", required=True)
    wait.add_argument("--chips", type=int, required=True)
    wait.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    if args.cmd == "token":
        _auth.write_token(Path(args.path))
        return 0
    if args.cmd == "ip":
        from ray._private.services import get_node_ip_address

        print(get_node_ip_address())
        return 0
    return {"head": cmd_head, "hosts": cmd_hosts, "wait": cmd_wait}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
