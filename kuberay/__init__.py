"""pathways_ray.kuberay: KubeRay manifests for GKE TPU slices, and a client that submits them.

Rendering needs only ``pathways_ray.clusters.topology`` and PyYAML; the client needs the
``kubernetes`` package (``pip install 'pathways-ray[kuberay]'``) and is imported
from ``pathways_ray.kuberay.client``.
"""

from .manifests import (
    ClusterConfig,
    example_entrypoint,
    openai_serve_config,
    ray_cluster,
    ray_job,
    ray_service,
    to_yaml,
)
from .schema import SchemaError, crd_schema, validate

__all__ = [
    "ClusterConfig",
    "SchemaError",
    "crd_schema",
    "example_entrypoint",
    "openai_serve_config",
    "ray_cluster",
    "ray_job",
    "ray_service",
    "to_yaml",
    "validate",
]
