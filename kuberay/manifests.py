"""RayCluster, RayJob and RayService manifests for GKE TPU node pools.

Pure: needs only ``pathways_ray.clusters.topology`` and PyYAML, never a cluster.
Every generator checks its arguments before building anything (``ValueError``
naming the field and the valid values) and validates the result against
KubeRay's CRD schema before returning it.

What a TPU worker group gets, per slice shape:
- ``numOfHosts`` = hosts of the topology, ``replicas`` = slices (with
  ``minReplicas``/``maxReplicas`` for autoscaling);
- ``google.com/tpu`` requests == limits == chips per host, CPU and memory
  sized to the GKE machine type, requests == limits;
- ``nodeSelector`` on ``cloud.google.com/gke-tpu-accelerator`` and
  ``cloud.google.com/gke-tpu-topology``;
- ``/dev/shm`` in memory for Ray's object store; readiness and liveness probes
  on the raylet (and the GCS on the head); the megascale port for multi-host
  and multi-slice training;
- Ray token authentication on (``authOptions.mode: token``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from pathways_ray.clusters.host_plan import NODE_ENV
from pathways_ray.clusters.topology import Topology
from pathways_ray.config import CACHE_ENV

from .schema import validate

__all__ = [
    "ClusterConfig",
    "openai_serve_config",
    "ray_cluster",
    "ray_job",
    "ray_service",
    "to_yaml",
]

DEFAULT_RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = "rayproject/ray:2.60.0-py312"
MEGASCALE_PORT = 8081

# vCPUs and GiB of memory of each GKE TPU machine type (GKE's TPU machine table).
# Pods ask for 80% of the CPUs and 75% of the memory, leaving room for GKE's
# system reservation and daemonsets; override with worker_cpu / worker_memory.
MACHINES: dict[str, tuple[int, int]] = {
    "ct4p-hightpu-4t": (240, 407),
    "ct5lp-hightpu-1t": (24, 48),
    "ct5lp-hightpu-4t": (112, 192),
    "ct5lp-hightpu-8t": (224, 384),
    "ct5p-hightpu-4t": (208, 448),
    "ct6e-standard-1t": (44, 176),
    "ct6e-standard-4t": (180, 720),
    "ct6e-standard-8t": (180, 1440),
    "tpu7x-standard-4t": (224, 960),
}

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$")
_LABELS = {"app.kubernetes.io/part-of": "pathways-ray"}


def _check_name(field_name: str, value: str, pattern: re.Pattern, what: str, limit: int) -> None:
    if not isinstance(value, str) or len(value) > limit or not pattern.match(value):
        start = "a letter" if what == "DNS-1035 label" else "a letter or digit"
        raise ValueError(
            f"{field_name}={value!r} is not a {what}: use at most {limit} lowercase letters, "
            f"digits and '-', starting with {start} and ending with a letter or digit"
        )


def _check_quantity(field_name: str, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not _QUANTITY.match(value)):
        raise ValueError(
            f"{field_name}={value!r} is not a Kubernetes quantity; write e.g. '8', '500m', "
            f"'32Gi'"
        )


@dataclass(frozen=True)
class ClusterConfig:
    """Everything a TPU RayCluster needs; shared by the three generators."""

    name: str
    accelerator: str
    topology: str | None = None
    chips_per_host: int | None = None
    num_slices: int = 1
    min_slices: int | None = None
    max_slices: int | None = None
    namespace: str = "default"
    image: str = DEFAULT_IMAGE
    ray_version: str = DEFAULT_RAY_VERSION
    head_cpu: str = "8"
    head_memory: str = "32Gi"
    worker_cpu: str | None = None
    worker_memory: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    service_account: str | None = None
    # Where chip workers keep compiled programs between runs, shared by every host and
    # every job of the team: "gs://bucket/path" (the image needs pathways-ray[gcs], the
    # service account the bucket), or "pvc:<claim>" (a ReadWriteMany volume, mounted at
    # /xla-cache). None: each chip worker's local default, lost with its pod.
    compilation_cache: str | None = None

    def __post_init__(self) -> None:
        _check_name("name", self.name, _DNS_1035, "DNS-1035 label", 63)
        _check_name("namespace", self.namespace, _DNS_1123, "DNS-1123 label", 63)
        if isinstance(self.num_slices, bool) or not isinstance(self.num_slices, int) or (
            self.num_slices < 1
        ):
            raise ValueError(f"num_slices={self.num_slices!r} must be a whole number >= 1")
        lo = self.num_slices if self.min_slices is None else self.min_slices
        hi = self.num_slices if self.max_slices is None else self.max_slices
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= self.num_slices <= hi):
            raise ValueError(
                f"min_slices={self.min_slices!r}, num_slices={self.num_slices}, max_slices="
                f"{self.max_slices!r}: need 0 <= min_slices <= num_slices <= max_slices"
            )
        if not isinstance(self.image, str) or not self.image or " " in self.image:
            raise ValueError(f"image={self.image!r} must be a container image reference")
        if not re.match(r"^[0-9]+\.[0-9]+\.[0-9]+$", str(self.ray_version)):
            raise ValueError(f"ray_version={self.ray_version!r} must look like '2.60.0'")
        for name in ("head_cpu", "head_memory", "worker_cpu", "worker_memory"):
            _check_quantity(name, getattr(self, name))
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError(f"env={self.env!r} must map strings to strings")
        cache = self.compilation_cache
        if cache is not None and not (
            isinstance(cache, str) and (re.match(r"^gs://[a-z0-9][a-z0-9._-]{1,221}(/.*)?$", cache)
                                        or (cache.startswith("pvc:")
                                            and _DNS_1123.match(cache[4:])))):
            raise ValueError(f"compilation_cache={cache!r} must be a bucket path "
                             f"('gs://my-bucket/xla-cache') or a ReadWriteMany volume claim "
                             f"('pvc:xla-cache')")
        self.tpu  # noqa: B018 - parse now so a bad accelerator/topology fails here

    @property
    def tpu(self) -> Topology:
        return Topology.parse(self.accelerator, self.topology, chips_per_host=self.chips_per_host)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas != self.max_replicas

    @property
    def min_replicas(self) -> int:
        return self.num_slices if self.min_slices is None else self.min_slices

    @property
    def max_replicas(self) -> int:
        return self.num_slices if self.max_slices is None else self.max_slices


def _probes(head: bool) -> dict[str, Any]:
    # The same checks KubeRay injects by default, stated explicitly.
    check = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
    if head:
        check += " && wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success"
    command = {"exec": {"command": ["bash", "-c", check]}}
    return {
        "readinessProbe": {**command, "initialDelaySeconds": 10, "periodSeconds": 5,
                           "timeoutSeconds": 2, "successThreshold": 1, "failureThreshold": 10},
        "livenessProbe": {**command, "initialDelaySeconds": 30, "periodSeconds": 5,
                          "timeoutSeconds": 2, "successThreshold": 1, "failureThreshold": 120},
    }


def _shm() -> tuple[dict, dict]:
    """Ray's object store lives in /dev/shm; the container default (64 MiB) is far too small."""
    volume = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    mount = {"name": "dshm", "mountPath": "/dev/shm"}
    return volume, mount


CACHE_MOUNT = "/xla-cache"


def _env(cfg: ClusterConfig, extra: dict[str, str] | None = None) -> list[dict]:
    merged = {**NODE_ENV, **cfg.env, **(extra or {})}  # what every pathways-ray node has
    if cfg.compilation_cache:
        path = cfg.compilation_cache
        merged.setdefault(CACHE_ENV, CACHE_MOUNT if path.startswith("pvc:") else path)
    return [{"name": k, "value": v} for k, v in sorted(merged.items())]


def _cache_volume(cfg: ClusterConfig, pod: dict, container: dict) -> None:
    """Mount the team's compilation cache volume, when it is one."""
    if cfg.compilation_cache and cfg.compilation_cache.startswith("pvc:"):
        pod["volumes"].append({"name": "xla-cache", "persistentVolumeClaim":
                               {"claimName": cfg.compilation_cache[4:]}})
        container["volumeMounts"].append({"name": "xla-cache", "mountPath": CACHE_MOUNT})


def _head(cfg: ClusterConfig, serve: bool) -> dict:
    volume, mount = _shm()
    ports = [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
             {"containerPort": 10001, "name": "client"}, {"containerPort": 8080, "name": "metrics"}]
    if serve:
        ports.append({"containerPort": 8000, "name": "serve"})
    container = {
        "name": "ray-head",
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "resources": {
            "requests": {"cpu": cfg.head_cpu, "memory": cfg.head_memory},
            "limits": {"cpu": cfg.head_cpu, "memory": cfg.head_memory},
        },
        "ports": ports,
        "volumeMounts": [mount],
        **_probes(head=True),
    }
    env = _env(cfg)
    if env:
        container["env"] = env
    pod: dict[str, Any] = {"containers": [container], "volumes": [volume]}
    _cache_volume(cfg, pod, container)
    if cfg.service_account:
        pod["serviceAccountName"] = cfg.service_account
    return {"rayStartParams": {}, "template": {"metadata": {"labels": dict(_LABELS)},
                                               "spec": pod}}


def _worker_group(cfg: ClusterConfig) -> dict:
    tpu = cfg.tpu
    cpus, mem_gib = MACHINES[tpu.machine_type]
    cpu = cfg.worker_cpu or str(int(cpus * 0.8))
    memory = cfg.worker_memory or f"{int(mem_gib * 0.75)}Gi"
    chips = str(tpu.chips_per_host)
    volume, mount = _shm()
    container: dict[str, Any] = {
        "name": "ray-worker",
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "resources": {
            "requests": {"cpu": cpu, "memory": memory, "google.com/tpu": chips},
            "limits": {"cpu": cpu, "memory": memory, "google.com/tpu": chips},
        },
        "volumeMounts": [mount],
        **_probes(head=False),
    }
    if not tpu.is_single_host or cfg.max_replicas > 1:
        # Multi-host slices and multi-slice (DCN) training talk over the megascale port.
        container["ports"] = [{"containerPort": MEGASCALE_PORT, "name": "mxla"}]
    env = _env(cfg, {"ENABLE_PJRT_COMPATIBILITY": "true"})
    container["env"] = env
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": [volume],
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": tpu.name,
        },
    }
    _cache_volume(cfg, pod, container)
    if cfg.service_account:
        pod["serviceAccountName"] = cfg.service_account
    return {
        "groupName": f"tpu-{tpu.generation.name}-{tpu.name}",
        "replicas": cfg.num_slices,
        "minReplicas": cfg.min_replicas,
        "maxReplicas": cfg.max_replicas,
        "numOfHosts": tpu.num_hosts,
        "rayStartParams": {},
        "template": {"metadata": {"labels": dict(_LABELS)}, "spec": pod},
    }


def _cluster_spec(cfg: ClusterConfig, serve: bool = False) -> dict:
    spec: dict[str, Any] = {
        "rayVersion": cfg.ray_version,
        "authOptions": {"mode": "token"},
        "headGroupSpec": _head(cfg, serve),
        "workerGroupSpecs": [_worker_group(cfg)],
    }
    if cfg.autoscaling:
        spec["enableInTreeAutoscaling"] = True
    return spec


def _metadata(cfg: ClusterConfig) -> dict:
    return {"name": cfg.name, "namespace": cfg.namespace, "labels": dict(_LABELS)}


def _finish(manifest: dict) -> dict:
    validate(manifest)  # raises SchemaError listing every problem
    return manifest


def ray_cluster(cfg: ClusterConfig) -> dict:
    """A RayCluster with one TPU worker group (``num_slices`` replicas of the slice)."""
    return _finish({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                    "metadata": _metadata(cfg), "spec": _cluster_spec(cfg)})


def example_entrypoint(cfg: ClusterConfig, script: str = "examples/train_jax_lm.py") -> str:
    """The command that runs a training example on exactly the slices ``cfg`` asks for."""
    topo = cfg.tpu
    cmd = (f"python {script} --accelerator {topo.generation.name} --topology {topo.name} "
           f"--slices {cfg.num_slices}")
    if cfg.chips_per_host is not None:
        cmd += f" --chips-per-host {topo.chips_per_host}"
    return cmd


def ray_job(
    cfg: ClusterConfig,
    entrypoint: str,
    *,
    runtime_env: dict | None = None,
    ttl_seconds_after_finished: int = 600,
    active_deadline_seconds: int | None = None,
) -> dict:
    """A RayJob that runs ``entrypoint`` (what you would pass to ``ray job submit --``)
    on a fresh TPU RayCluster, deleted when the job is done."""
    if not isinstance(entrypoint, str) or not entrypoint.strip():
        raise ValueError(
            f"entrypoint={entrypoint!r} must be a command, e.g. 'python examples/train_jax_lm.py'"
        )
    if runtime_env is not None and not isinstance(runtime_env, dict):
        raise ValueError(f"runtime_env={runtime_env!r} must be a mapping (Ray runtime_env)")
    if runtime_env and "working_dir" in runtime_env:
        wd = runtime_env["working_dir"]
        if not re.match(r"^(https?|gs|s3)://", str(wd)):
            raise ValueError(
                f"runtime_env.working_dir={wd!r} must be a remote URI (https://…zip, gs://…, "
                f"s3://…): a RayJob's submitter cannot upload a local directory"
            )
    if not isinstance(ttl_seconds_after_finished, int) or ttl_seconds_after_finished < 0:
        raise ValueError(f"ttl_seconds_after_finished={ttl_seconds_after_finished!r} must be >= 0")
    spec: dict[str, Any] = {
        "entrypoint": entrypoint.strip(),
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": ttl_seconds_after_finished,
        "rayClusterSpec": _cluster_spec(cfg),
    }
    if runtime_env:
        spec["runtimeEnvYAML"] = yaml.safe_dump(runtime_env, sort_keys=True)
    if active_deadline_seconds is not None:
        if not isinstance(active_deadline_seconds, int) or active_deadline_seconds < 1:
            raise ValueError(f"active_deadline_seconds={active_deadline_seconds!r} must be >= 1")
        spec["activeDeadlineSeconds"] = active_deadline_seconds
    return _finish({"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _metadata(cfg),
                    "spec": spec})


def openai_serve_config(
    cfg: ClusterConfig,
    *,
    model_id: str,
    model_source: str | None = None,
    max_model_len: int = 8192,
    enable_expert_parallel: bool = True,
    engine_kwargs: dict | None = None,
) -> dict:
    """Ray Serve config for an OpenAI-compatible vLLM app, one replica per slice.

    The replica spans the whole slice: ``tensor_parallel_size`` = chips of the
    slice, placed by Ray Serve LLM on the slice's topology (see
    ``pathways_ray.serve.llm_config_dict``).
    """
    from pathways_ray.serve import plan

    tpu = cfg.tpu
    llm = plan.llm_config_dict(
        model_id, accelerator=tpu.generation.name, topology=tpu.name,
        chips_per_host=tpu.chips_per_host, model_source=model_source,
        enable_expert_parallel=enable_expert_parallel, max_model_len=max_model_len,
        num_slices=(cfg.min_replicas, cfg.max_replicas), initial_slices=cfg.num_slices,
        engine_kwargs=engine_kwargs)
    return plan.openai_serve_config(llm)


def ray_service(cfg: ClusterConfig, serve_config: dict) -> dict:
    """A RayService running ``serve_config`` (see ``openai_serve_config``) on the TPU cluster."""
    if not isinstance(serve_config, dict) or not serve_config.get("applications"):
        raise ValueError(
            "serve_config must be a Ray Serve config with an 'applications' list; build one "
            "with openai_serve_config(...)"
        )
    spec = {
        "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
        "rayClusterConfig": _cluster_spec(cfg, serve=True),
    }
    return _finish({"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": _metadata(cfg),
                    "spec": spec})


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # no &id001 anchors in manifests people read
        return True


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(*manifests: dict) -> str:
    """YAML for ``kubectl apply -f``; multi-line strings (serve configs) as blocks."""
    return "---\n".join(
        yaml.dump(m, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
        for m in manifests
    )
