"""What each TPU host is: its platform (``detect_platform``), and for an emulated one its
slice, TPU worker id, env, resources and the ``ray start`` command that brings it up.
Pure (Ray only to count a real host's chips)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pathways_ray.clusters.topology import Topology
from pathways_ray.config import PLATFORM_ENV

__all__ = ["HEAD_SYSTEM_CONFIG", "NODE_ENV", "HostPlan", "detect_platform", "plan_hosts",
           "ray_start_command"]

# GCS notices a dead emulated host within ~5 s instead of Ray's default ~60 s.
HEAD_SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 5,
}

# Env of every node of a pathways-ray cluster (emulated hosts, Slurm nodes, KubeRay
# pods); the node's own environment wins over it. Only Ray Serve reads these, at
# import, in each of its processes (controller, proxy, replicas):
# - Ray's high-throughput mode (its KubeRay guide sets it on every pod): deployments
#   call each other over gRPC instead of Ray actor calls, and replicas run user code
#   on their main event loop. Measured on the 32-stream serving benchmark: the
#   serving path's CPU per token 2.2 vs 2.6-2.9 CPU-s per 1,000 tokens, the ingress
#   0.6 vs 0.9-1.0, the replica 0.4 vs 0.6; with gRPC off and the rest on, no change
#   (2.6). A replica lost under a gRPC call still raises RayActorError
#   (ActorUnavailableError), which the failover ingress resends on.
# - and the HTTP proxy's calls to the ingress over gRPC too: Ray 2.60 derives that
#   setting from RAY_SERVE_USE_GRPC_BY_DEFAULT before the mode turns the latter on,
#   so the mode alone leaves the proxy on actor calls (1.9 instead of 2.2, the proxy
#   0.3 instead of 0.5);
# - but the HTTP proxy stays: the mode's direct ingress binds every app's ingress
#   to port 8000 of its node, one app per node, with no proxy in front;
# - and a replica's log lines reach its log file when they are written: the mode
#   buffers 1,000 records, flushed early only by an error, so a warning such as
#   the failover ingress's "sending it again" would sit unseen.
NODE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}


@dataclass(frozen=True)
class HostPlan:
    """One emulated TPU host: which slice, which TPU worker, and its env."""

    slice_name: str
    worker_id: int
    topology: Topology
    num_cpus: int

    @property
    def key(self) -> str:
        return f"{self.slice_name}/{self.worker_id}"

    @property
    def env(self) -> dict[str, str]:
        return self.topology.host_env(self.slice_name, self.worker_id)

    @property
    def resources(self) -> dict[str, float]:
        # Only TPU: Ray adds accelerator_type, <slice name> and TPU-<pod>-head itself.
        return {"TPU": self.topology.chips_per_host}

    def start_args(self, address: str) -> list[str]:
        """``ray start`` arguments that join this host to the head at ``address``."""
        return [f"--address={address}", f"--num-cpus={self.num_cpus}",
                f"--resources={json.dumps(self.resources)}"]


def plan_hosts(slices: Sequence[Topology], cpus_per_host: int | None = None) -> list[HostPlan]:
    """Name every slice ``<gen>-<shape>-<index>`` and lay out its hosts."""
    plans = []
    for index, topo in enumerate(slices):
        name = f"{topo.generation.name}-{topo.name}-{index}"
        cpus = cpus_per_host or max(4, 2 * topo.chips_per_host)
        for worker_id in range(topo.num_hosts):
            plans.append(HostPlan(name, worker_id, topo, cpus))
    return plans


def ray_start_command(temp_dir: Path, object_store_mb: int, ports: Sequence[int],
                      args: Sequence[str]) -> list[str]:
    """``ray start`` for one node; ``ports`` are its dashboard agent (listen, gRPC),
    runtime-env agent and metrics ports, distinct for every node of the machine."""
    exe = Path(sys.executable).with_name("ray")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "ray.scripts.scripts"]
    listen, grpc, runtime_env, metrics = ports
    return cli + [
        "start",
        f"--temp-dir={temp_dir}",
        f"--object-store-memory={object_store_mb * 1024 * 1024}",
        "--disable-usage-stats",
        "--min-worker-port=0",
        "--max-worker-port=0",
        f"--dashboard-agent-listen-port={listen}",
        f"--dashboard-agent-grpc-port={grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        *args,
    ]


def detect_platform() -> str:
    """``"tpu"`` where this host has TPU chips, ``"cpu"`` on an emulated host
    (``$PATHWAYS_RAY_PLATFORM`` overrides)."""
    forced = os.environ.get(PLATFORM_ENV)
    if forced:
        if forced not in ("cpu", "tpu"):
            raise ValueError(f"{PLATFORM_ENV}={forced!r} must be 'cpu' or 'tpu'")
        return forced
    from ray._private.accelerators.tpu import TPUAcceleratorManager

    return "tpu" if TPUAcceleratorManager.get_current_node_num_accelerators() > 0 else "cpu"
