"""A small typed client for KubeRay resources, over the official ``kubernetes`` package.

    from pathways_ray.kuberay.client import KubeRayClient
    kr = KubeRayClient.from_kubeconfig()
    kr.create(manifest)
    kr.wait_ready("RayCluster", "tpu-v6e-16", timeout_s=900)

Failures are typed (``AlreadyExists``, ``NotFound``, ``Forbidden``,
``WaitTimeout``, ``Invalid``) instead of ``None`` or raw HTTP errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .schema import KINDS, validate

__all__ = [
    "AlreadyExists",
    "Forbidden",
    "Invalid",
    "KubeRayClient",
    "KubeRayError",
    "NotFound",
    "WaitTimeout",
]

GROUP, VERSION = "ray.io", "v1"
PLURALS = {"RayCluster": "rayclusters", "RayJob": "rayjobs", "RayService": "rayservices"}


class KubeRayError(RuntimeError):
    """A request to the Kubernetes API failed."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class AlreadyExists(KubeRayError):
    """409: a resource of that kind and name exists in the namespace."""


class NotFound(KubeRayError):
    """404: no such resource (or the KubeRay CRDs are not installed)."""


class Forbidden(KubeRayError):
    """401/403: the credentials may not do this (check RBAC for ray.io resources)."""


class Invalid(KubeRayError):
    """422: the API server rejected the object."""


class WaitTimeout(KubeRayError, TimeoutError):
    """A resource did not reach the wanted state before the deadline."""


def _kind(kind: str) -> str:
    if kind not in PLURALS:
        raise ValueError(f"kind={kind!r} is not a KubeRay kind; use one of {list(PLURALS)}")
    return PLURALS[kind]


# What "ready" means per kind, and which states mean it never will be.
def _cluster_state(obj: dict) -> tuple[bool, str | None]:
    status = obj.get("status") or {}
    if status.get("state") == "ready":
        return True, None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "RayClusterProvisioned" and cond.get("status") == "True" and (
            status.get("readyWorkerReplicas", 0) >= status.get("desiredWorkerReplicas", 1)
        ):
            return True, None
    if status.get("state") == "failed":
        return False, status.get("reason") or "RayCluster failed"
    return False, None


def _job_state(obj: dict) -> tuple[bool, str | None]:
    status = obj.get("status") or {}
    if status.get("jobStatus") == "SUCCEEDED":
        return True, None
    if status.get("jobStatus") in ("FAILED", "STOPPED") or status.get(
        "jobDeploymentStatus"
    ) == "Failed":
        return False, f"RayJob {status.get('jobStatus') or 'Failed'}: {status.get('message', '')}"
    return False, None


def _service_state(obj: dict) -> tuple[bool, str | None]:
    status = obj.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            return True, None
    if status.get("serviceStatus") == "Running":
        return True, None
    return False, None


_READY: dict[str, Callable[[dict], tuple[bool, str | None]]] = {
    "RayCluster": _cluster_state,
    "RayJob": _job_state,
    "RayService": _service_state,
}


class KubeRayClient:
    """Create, get, list, delete and wait for RayClusters, RayJobs and RayServices."""

    def __init__(self, api_client: Any, *, default_namespace: str = "default"):
        from kubernetes import client

        self._api = client.CustomObjectsApi(api_client)
        self.namespace = default_namespace

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, context: str | None = None,
                        **kw) -> KubeRayClient:
        """Credentials from ``~/.kube/config`` (or ``path``), as kubectl uses them."""
        from kubernetes import config

        try:
            api_client = config.new_client_from_config(config_file=path, context=context)
        except config.ConfigException as e:
            raise KubeRayError(
                f"no usable kubeconfig ({e}); run `gcloud container clusters get-credentials "
                f"CLUSTER`, or pass --kubeconfig, or --server with --token"
            ) from e
        return cls(api_client, **kw)

    @classmethod
    def for_host(cls, host: str, *, token: str | None = None, verify_ssl: bool = True,
                 **kw) -> KubeRayClient:
        """An explicit API server address (and bearer token)."""
        from kubernetes import client

        conf = client.Configuration(host=host)
        conf.verify_ssl = verify_ssl
        if token:
            conf.api_key = {"authorization": token}
            conf.api_key_prefix = {"authorization": "Bearer"}
        return cls(client.ApiClient(conf), **kw)

    # ---- CRUD -----------------------------------------------------------------
    def create(self, manifest: dict, namespace: str | None = None) -> dict:
        """Create ``manifest`` (validated against its CRD first); returns the stored object."""
        validate(manifest)
        kind = manifest["kind"]
        ns = namespace or manifest.get("metadata", {}).get("namespace") or self.namespace
        name = manifest["metadata"]["name"]
        return self._call(f"create {kind} {ns}/{name}", self._api.create_namespaced_custom_object,
                          GROUP, VERSION, ns, _kind(kind), manifest)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict:
        ns = namespace or self.namespace
        return self._call(f"get {kind} {ns}/{name}", self._api.get_namespaced_custom_object,
                          GROUP, VERSION, ns, _kind(kind), name)

    def list(self, kind: str, namespace: str | None = None) -> list[dict]:
        ns = namespace or self.namespace
        out = self._call(f"list {kind} in {ns}", self._api.list_namespaced_custom_object,
                         GROUP, VERSION, ns, _kind(kind))
        return list(out.get("items", []))

    def delete(self, kind: str, name: str, namespace: str | None = None) -> None:
        ns = namespace or self.namespace
        self._call(f"delete {kind} {ns}/{name}", self._api.delete_namespaced_custom_object,
                   GROUP, VERSION, ns, _kind(kind), name)

    def wait_ready(self, kind: str, name: str, namespace: str | None = None, *,
                   timeout_s: float = 900.0, poll_s: float = 5.0) -> dict:
        """Poll until the resource is ready: a RayCluster ``ready``, a RayJob ``SUCCEEDED``,
        a RayService ``Ready``. Raises ``KubeRayError`` on failure, ``WaitTimeout`` at the
        deadline."""
        if kind not in _READY:
            raise ValueError(f"kind={kind!r} is not a KubeRay kind; use one of {list(KINDS)}")
        deadline = time.monotonic() + timeout_s
        last: dict = {}
        while True:
            last = self.get(kind, name, namespace)
            ok, failure = _READY[kind](last)
            if ok:
                return last
            if failure:
                raise KubeRayError(f"{kind} {name} failed: {failure}")
            if time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"{kind} {name} not ready within timeout_s={timeout_s:g}; last status: "
                    f"{last.get('status') or 'none yet'}"
                )
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    # ---- errors ---------------------------------------------------------------------
    def _call(self, what: str, fn, *args):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args)
        except ApiException as e:
            raise _typed(what, e) from e
        except (HTTPError, OSError) as e:  # connection refused, DNS, TLS, retries used up
            raise KubeRayError(f"{what}: cannot reach the Kubernetes API: {e}") from e


def _typed(what: str, e) -> KubeRayError:
    import json

    reason = e.reason or ""
    try:
        reason = json.loads(e.body).get("message") or reason
    except (TypeError, ValueError):
        pass
    cls = {409: AlreadyExists, 404: NotFound, 403: Forbidden, 401: Forbidden,
           422: Invalid}.get(e.status, KubeRayError)
    hint = {
        NotFound: " (is it spelled right, and are the KubeRay CRDs installed?)",
        Forbidden: " (check the RBAC rules for ray.io resources in this namespace)",
    }.get(cls, "")
    return cls(f"{what}: {e.status} {reason}{hint}", status=e.status)
