"""The checked-in samples in ``kuberay/samples/``, and how to re-render them.

    python -m pathways_ray.kuberay.samples [kuberay/samples]

A test re-renders every sample and fails on any difference, so the files
always show what the generators produce.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from .manifests import (
    ClusterConfig,
    example_entrypoint,
    openai_serve_config,
    ray_cluster,
    ray_job,
    ray_service,
    to_yaml,
)

IMAGE = "us-docker.pkg.dev/my-project/pathways-ray/pathways-ray:0.1.0-py312"

SAMPLES: dict[str, Callable[[], dict | list[dict]]] = {
    "ray-cluster.v6e-2x4-single-host.yaml": lambda: ray_cluster(
        ClusterConfig(name="pathways-v6e-8", accelerator="v6e", topology="2x4", image=IMAGE)
    ),
    "ray-cluster.v6e-4x4-multi-host.yaml": lambda: ray_cluster(
        ClusterConfig(name="pathways-v6e-16", accelerator="v6e", topology="4x4", image=IMAGE,
                      compilation_cache="pvc:xla-cache")
    ),
    "ray-cluster.v5p-2x2x2-multi-slice.yaml": lambda: ray_cluster(
        ClusterConfig(name="pathways-v5p-16x2", accelerator="v5p", topology="2x2x2",
                      num_slices=2, min_slices=1, max_slices=4, image=IMAGE)
    ),
    "ray-cluster.v6e-4x4-proxy.yaml": lambda: _proxy(),
    "ray-job.v6e-4x4-train-jax-lm.yaml": lambda: _job(),
    "ray-service.v6e-4x4-llm.yaml": lambda: _service(),
}


def _proxy() -> list[dict]:
    """A cluster serving unmodified JAX to notebook pods, and one such pod."""
    from .proxy import ProxyConfig, client_pod, proxy_cluster

    cfg = ClusterConfig(name="pathways-v6e-16x2", accelerator="v6e", topology="4x4",
                        num_slices=2, image=IMAGE)
    proxy = ProxyConfig(secret="pathways-proxy-token")  # kubectl create secret generic …
    return [*proxy_cluster(cfg, proxy), client_pod(cfg, proxy, image=IMAGE)]


def _job() -> dict:
    cfg = ClusterConfig(name="train-jax-lm", accelerator="v6e", topology="4x4", image=IMAGE,
                        service_account="pathways-ray",  # may read and write the bucket
                        compilation_cache="gs://my-team-bucket/pathways-ray/xla-cache")
    return ray_job(cfg, example_entrypoint(cfg), runtime_env={
        "working_dir": "https://github.com/my-org/pathways-ray/archive/main.zip"})


def _service() -> dict:
    cfg = ClusterConfig(name="llm-v6e-16", accelerator="v6e", topology="4x4",
                        image="us-docker.pkg.dev/my-project/pathways-ray/vllm-tpu:0.1.0-py312",
                        env={"VLLM_XLA_CACHE_PATH": "/tmp/vllm-xla-cache"})
    return ray_service(cfg, openai_serve_config(cfg, model_id="Qwen/Qwen3-30B-A3B",
                                                max_model_len=8192, enable_expert_parallel=True))


HEADER = "# Rendered by `python -m pathways_ray.kuberay.samples`; edit kuberay/samples.py.\n"


def render(name: str) -> str:
    manifests = SAMPLES[name]()
    return HEADER + to_yaml(*(manifests if isinstance(manifests, list) else [manifests]))


def write_all(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name in SAMPLES:
        path = directory / name
        path.write_text(render(name))
        out.append(path)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "samples"
    for p in write_all(target):
        print(p)
