"""The KubeRay client and `pathways-ray k8s` against a local custom-objects API server.

The `kubernetes` package and HTTP are real; the server is tests/kube_api_server.py.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import yaml

from pathways_ray.cli.main import main as cli_main
from pathways_ray.kuberay import ClusterConfig, SchemaError, ray_cluster, ray_job, to_yaml
from pathways_ray.kuberay.client import (
    AlreadyExists,
    Forbidden,
    KubeRayClient,
    KubeRayError,
    NotFound,
    WaitTimeout,
)
from tests.kube_api_server import KubeApiServer

TOKEN = "test-token"


@pytest.fixture()
def server():
    with KubeApiServer(token=TOKEN, forbidden_namespaces=("locked",)) as s:
        yield s


@pytest.fixture()
def client(server):
    return KubeRayClient.for_host(server.url, token=TOKEN)


def cluster(name="tpu", namespace="default"):
    return ray_cluster(ClusterConfig(name=name, namespace=namespace, accelerator="v6e",
                                     topology="4x4"))


def later(fn, delay_s=0.3):
    t = threading.Timer(delay_s, fn)
    t.start()
    return t


def test_create_get_list_delete(server, client):
    """Objects round-trip through the API with server-side metadata and CRD defaults."""
    created = client.create(cluster())
    assert created["metadata"]["uid"] and created["kind"] == "RayCluster"
    got = client.get("RayCluster", "tpu")
    assert got["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 4
    client.create(cluster("other"))
    assert [o["metadata"]["name"] for o in client.list("RayCluster")] == ["other", "tpu"]
    assert client.list("RayJob") == []
    client.delete("RayCluster", "tpu")
    with pytest.raises(NotFound, match="tpu"):
        client.get("RayCluster", "tpu")
    assert ("POST", "/apis/ray.io/v1/namespaces/default/rayclusters") in server.requests


def test_typed_errors(server, client):
    """409, 404, 403 and 401 become AlreadyExists, NotFound and Forbidden, never None."""
    client.create(cluster())
    with pytest.raises(AlreadyExists, match="already exists"):
        client.create(cluster())
    with pytest.raises(NotFound, match="CRDs installed"):
        client.delete("RayJob", "nope")
    with pytest.raises(Forbidden, match="RBAC"):
        client.create(cluster(namespace="locked"))
    with pytest.raises(Forbidden):
        KubeRayClient.for_host(server.url, token="wrong").list("RayCluster")
    with pytest.raises(ValueError, match="kind='Pod'"):
        client.get("Pod", "x")


def test_invalid_manifest_is_refused_before_any_request(server, client):
    """A manifest that fails the CRD schema never reaches the API server."""
    m = cluster()
    m["spec"]["bogus"] = True
    before = len(server.requests)
    with pytest.raises(SchemaError, match="bogus"):
        client.create(m)
    assert len(server.requests) == before


def test_wait_ready_for_each_kind(server, client):
    """wait_ready returns once the operator reports ready, fails fast on failure, and
    times out naming the timeout and the last status."""
    client.create(cluster())
    later(lambda: server.set_status("rayclusters", "default", "tpu", {"state": "ready"}))
    assert client.wait_ready("RayCluster", "tpu", timeout_s=10, poll_s=0.1)["status"][
        "state"] == "ready"

    job = ray_job(ClusterConfig(name="train", accelerator="v6e", topology="2x4"),
                  "python examples/train_jax_lm.py")
    client.create(job)
    later(lambda: server.set_status("rayjobs", "default", "train",
                                    {"jobStatus": "FAILED", "message": "exit 1"}))
    with pytest.raises(KubeRayError, match="FAILED"):
        client.wait_ready("RayJob", "train", timeout_s=10, poll_s=0.1)

    t0 = time.monotonic()
    client.create(cluster("slow"))
    with pytest.raises(WaitTimeout, match="timeout_s=0.5"):
        client.wait_ready("RayCluster", "slow", timeout_s=0.5, poll_s=0.1)
    assert time.monotonic() - t0 < 5


def test_unreachable_api_server():
    """A closed port is a KubeRayError saying the API cannot be reached."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kr = KubeRayClient.for_host(f"http://127.0.0.1:{port}")
    with pytest.raises(KubeRayError, match="cannot reach"):
        kr.list("RayCluster")


def test_cli_render_submit_status_delete(server, tmp_path, capsys):
    """`pathways-ray k8s render > file`, then submit --wait, status and delete."""
    assert cli_main(["k8s", "render", "cluster", "--name", "tpu", "--accelerator", "v6e",
                     "--topology", "4x4", "--slices", "2"]) == 0
    rendered = capsys.readouterr().out
    doc = yaml.safe_load(rendered)
    assert doc["spec"]["workerGroupSpecs"][0]["replicas"] == 2
    path = tmp_path / "cluster.yaml"
    path.write_text(rendered)
    api = ["--server", server.url, "--token", TOKEN]
    later(lambda: server.set_status("rayclusters", "default", "tpu", {"state": "ready"}), 0.5)
    assert cli_main(["k8s", "submit", "-f", str(path), "--wait", "--timeout", "30", *api]) == 0
    out = capsys.readouterr().out
    assert "created RayCluster default/tpu" in out and "is ready" in out
    assert cli_main(["k8s", "status", *api]) == 0
    assert "RayCluster  tpu" in capsys.readouterr().out
    assert cli_main(["k8s", "status", "cluster", "tpu", *api]) == 0
    assert "state: ready" in capsys.readouterr().out
    assert cli_main(["k8s", "delete", "cluster", "tpu", *api]) == 0
    assert cli_main(["k8s", "delete", "cluster", "tpu", *api]) == 1
    assert "not found" in capsys.readouterr().err


def test_cli_submits_every_document_of_a_file(server, tmp_path, capsys):
    """A multi-document file creates each resource."""
    path = tmp_path / "all.yaml"
    path.write_text(to_yaml(cluster("a"), cluster("b")))
    assert cli_main(["k8s", "submit", "-f", str(path), "--server", server.url,
                     "--token", TOKEN]) == 0
    assert sorted(k[2] for k in server.objects) == ["a", "b"]


def test_cli_submit_refuses_a_proxy_file_whole_and_says_to_use_kubectl(server, tmp_path,
                                                                       capsys):
    """The --proxy file has a Secret, Service and NetworkPolicy, which submit does not
    create: it says so and creates nothing (not the RayCluster without its Secret)."""
    from pathways_ray.kuberay.proxy import proxy_cluster

    path = tmp_path / "proxy.yaml"
    path.write_text(to_yaml(*proxy_cluster(ClusterConfig(name="tpu", accelerator="v6e",
                                                         topology="2x2"))))
    assert cli_main(["k8s", "submit", "-f", str(path), "--server", server.url,
                     "--token", TOKEN]) == 2
    err = capsys.readouterr().err
    assert "NetworkPolicy, Secret, Service" in err and f"kubectl apply -f {path}" in err
    assert not server.objects


def test_cli_render_rejects_bad_flags(capsys):
    """Bad render flags exit 2 naming the field."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["k8s", "render", "cluster", "--name", "tpu", "--accelerator", "v6e",
                  "--topology", "3x3"])
    assert exc.value.code == 2
    assert "topology='3x3'" in capsys.readouterr().err
