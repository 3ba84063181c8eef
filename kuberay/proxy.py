"""The IFRT proxy (``pathways-ray proxy``) on a KubeRay cluster: what a notebook or job
pod needs to run unmodified JAX on the cluster's slices (``JAX_PLATFORMS=proxy``).

Pure, like ``manifests``. ``proxy_cluster`` returns, in the order to apply them:

- a ``Secret`` holding the proxy's session token (a fresh random one; or none is
  rendered when ``ProxyConfig.secret`` names one you made);
- the ``RayCluster``, its head pod with a ``pathways-proxy`` container beside
  ``ray-head``: it waits for the head's GCS, then serves the proxy on
  ``ProxyConfig.port`` as a driver of the cluster (the two containers share the pod's
  network, ``/tmp/ray`` for the raylet's sockets and ``/dev/shm`` for the object store);
  the Ray token comes from the Secret KubeRay makes for ``authOptions`` (named as the
  cluster, key ``auth_token``), the proxy's from its own;
- a ``Service`` ``<name>-proxy`` on the head pod's proxy port;
- a ``NetworkPolicy`` that admits to the proxy port only pods labelled
  ``pathways-ray/proxy-client: <name>`` (and the cluster's own), leaving every other
  port of the head as it was (the gRPC is plain, and the token would cross the
  network in the clear: keep it to the pods that should use it).

``client_pod`` is a notebook pod that uses it (the docs' example).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from .manifests import ClusterConfig, _check_quantity, _cluster_spec, _finish, _metadata

__all__ = ["CLIENT_LABEL", "ProxyConfig", "client_pod", "proxy_cluster"]

PROXY_PORT = 29000  # Cloud Pathways' proxy port, so JAX_BACKEND_TARGET looks the same
CLIENT_LABEL = "pathways-ray/proxy-client"
TOKEN_KEY = "token"
RAY_TMP = "/tmp/ray"
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy beside a cluster's head. ``slices``: what each session gets, as
    ``pathways-ray proxy --slices`` takes it (default: every slice of the cluster);
    ``secret``: an existing Secret with the token under key ``token`` (default: one
    is rendered with a fresh token)."""

    port: int = PROXY_PORT
    slices: tuple[str, ...] = ()
    secret: str | None = None
    cpu: str = "2"
    memory: str = "8Gi"

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not (
                1024 <= self.port <= 65535) or self.port in (6379, 8265, 10001, 8080, 8000):
            raise ValueError(f"port={self.port!r} must be a free port in 1024..65535, not one "
                             f"of the Ray head's (6379, 8265, 10001, 8080, 8000)")
        if self.secret is not None and not (isinstance(self.secret, str) and len(
                self.secret) <= 253 and _DNS_1123_SUBDOMAIN.match(self.secret)):
            raise ValueError(f"secret={self.secret!r} is not a Secret name (lowercase letters, "
                             f"digits, '-' and '.', at most 253)")
        _check_quantity("cpu", self.cpu)
        _check_quantity("memory", self.memory)
        for s in self.slices:
            if not isinstance(s, str) or not re.match(r"^[a-z0-9]+-[0-9x]+(:[1-9][0-9]*)?$", s):
                raise ValueError(f"slices={self.slices!r}: each is SHAPE[:COUNT], "
                                 f"e.g. 'v6e-4x4:2'")


def secret_name(cfg: ClusterConfig, proxy: ProxyConfig) -> str:
    return proxy.secret or f"{cfg.name}-proxy-token"


def service_name(cfg: ClusterConfig) -> str:
    return f"{cfg.name}-proxy"


def backend_target(cfg: ClusterConfig, proxy: ProxyConfig) -> str:
    """``JAX_BACKEND_TARGET`` for a pod in the cluster."""
    return f"grpc://{service_name(cfg)}.{cfg.namespace}.svc.cluster.local:{proxy.port}"


def _head_selector(cfg: ClusterConfig) -> dict[str, str]:
    # The labels KubeRay gives a cluster's head pod.
    return {"ray.io/cluster": cfg.name, "ray.io/node-type": "head"}


def _proxy_container(cfg: ClusterConfig, proxy: ProxyConfig) -> dict:
    slices = proxy.slices or (f"{cfg.tpu}:{cfg.num_slices}",)
    serve = (f"exec pathways-ray proxy --address 127.0.0.1:6379 --host 0.0.0.0 "
             f"--port {proxy.port} --slices {' '.join(slices)}")
    wait = ("until ray health-check --address 127.0.0.1:6379 >/dev/null 2>&1; "
            "do echo waiting for the Ray head; sleep 2; done")
    token = {"secretKeyRef": {"name": secret_name(cfg, proxy), "key": TOKEN_KEY}}
    ray_token = {"secretKeyRef": {"name": cfg.name, "key": "auth_token"}}
    return {
        "name": "pathways-proxy",
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["bash", "-c", f"{wait}; {serve}"],
        "env": [{"name": "PATHWAYS_RAY_PROXY_TOKEN", "valueFrom": token},
                {"name": "RAY_AUTH_MODE", "value": "token"},
                {"name": "RAY_AUTH_TOKEN", "valueFrom": ray_token}],
        "ports": [{"containerPort": proxy.port, "name": "ifrt-proxy"}],
        "resources": {"requests": {"cpu": proxy.cpu, "memory": proxy.memory},
                      "limits": {"cpu": proxy.cpu, "memory": proxy.memory}},
        "readinessProbe": {"tcpSocket": {"port": proxy.port}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "ray-logs", "mountPath": RAY_TMP}],
    }


def _cluster(cfg: ClusterConfig, proxy: ProxyConfig) -> dict:
    spec = _cluster_spec(cfg)
    pod = spec["headGroupSpec"]["template"]["spec"]
    # The proxy is a driver of the head's raylet: it needs its socket files.
    pod["volumes"].append({"name": "ray-logs", "emptyDir": {}})
    pod["containers"][0]["volumeMounts"].append({"name": "ray-logs", "mountPath": RAY_TMP})
    pod["containers"].append(_proxy_container(cfg, proxy))
    return _finish({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                    "metadata": _metadata(cfg), "spec": spec})


def proxy_cluster(cfg: ClusterConfig, proxy: ProxyConfig | None = None) -> list[dict]:
    """The Secret (unless ``proxy.secret``), RayCluster, Service and NetworkPolicy of a
    cluster whose head serves the IFRT proxy."""
    proxy = proxy or ProxyConfig()
    meta = _metadata(cfg)
    out: list[dict[str, Any]] = []
    if proxy.secret is None:
        out.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {**meta, "name": secret_name(cfg, proxy)},
                    "stringData": {TOKEN_KEY: secrets.token_urlsafe(32)}})
    out.append(_cluster(cfg, proxy))
    out.append({"apiVersion": "v1", "kind": "Service",
                "metadata": {**meta, "name": service_name(cfg)},
                "spec": {"type": "ClusterIP", "selector": _head_selector(cfg),
                         "ports": [{"name": "ifrt-proxy", "port": proxy.port,
                                    "targetPort": proxy.port, "protocol": "TCP"}]}})
    below = [{"protocol": p, "port": 1, "endPort": proxy.port - 1} for p in ("TCP", "UDP")]
    above = [{"protocol": p, "port": proxy.port + 1, "endPort": 65535} for p in ("TCP", "UDP")]
    out.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {**meta, "name": service_name(cfg)},
                "spec": {"podSelector": {"matchLabels": _head_selector(cfg)},
                         "policyTypes": ["Ingress"],
                         "ingress": [
                             {"ports": below + above},  # the head's other ports: as before
                             {"from": [{"podSelector": {"matchLabels": {
                                           CLIENT_LABEL: cfg.name}}},
                                       {"podSelector": {"matchLabels": {
                                           "ray.io/cluster": cfg.name}}}],
                              "ports": [{"protocol": "TCP", "port": proxy.port}]}]}})
    return out


def client_pod(cfg: ClusterConfig, proxy: ProxyConfig | None = None, *,
               name: str = "notebook", image: str = "python:3.12",
               command: tuple[str, ...] = ("sleep", "infinity")) -> dict:
    """A pod the proxy admits (its label), with what a JAX program needs in its
    environment: ``JAX_PLATFORMS=proxy``, the Service as ``JAX_BACKEND_TARGET`` and the
    token from the Secret."""
    proxy = proxy or ProxyConfig()
    env = {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": backend_target(cfg, proxy),
           "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS": "true"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": cfg.namespace,
                         "labels": {CLIENT_LABEL: cfg.name}},
            "spec": {"containers": [{
                "name": name, "image": image, "command": list(command),
                "env": [{"name": k, "value": v} for k, v in env.items()] + [
                    {"name": "PATHWAYS_RAY_PROXY_TOKEN", "valueFrom": {"secretKeyRef": {
                        "name": secret_name(cfg, proxy), "key": TOKEN_KEY}}}]}]}}
