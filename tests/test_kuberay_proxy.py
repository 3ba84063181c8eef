"""``pathways-ray k8s render cluster --proxy``: the IFRT proxy beside a KubeRay head (pure).

The RayCluster is checked against KubeRay's CRD schema (and the GKE TPU rules every
cluster keeps); the Secret, Service, NetworkPolicy and client Pod, which have no CRD,
against the Kubernetes API's own models: each must survive a round trip through them
unchanged, so a misspelled or misplaced field (which the API server would drop) fails.
"""

from __future__ import annotations

import pytest
import yaml

from pathways_ray.clusters.topology import Topology
from pathways_ray.kuberay import ClusterConfig, validate
from pathways_ray.kuberay.proxy import (
    CLIENT_LABEL,
    PROXY_PORT,
    ProxyConfig,
    client_pod,
    proxy_cluster,
)
from tests.test_kuberay_manifests import check_gke_tpu_rules

CFG = ClusterConfig(name="tpu", accelerator="v6e", topology="4x4", num_slices=2)
MODELS = {"Secret": "V1Secret", "Service": "V1Service", "NetworkPolicy": "V1NetworkPolicy",
          "Pod": "V1Pod"}


def round_trips(manifest: dict) -> bool:
    from kubernetes import client

    api = client.ApiClient()
    model = api._ApiClient__deserialize(manifest, MODELS[manifest["kind"]])
    return api.sanitize_for_serialization(model) == manifest


def by_kind(manifests: list[dict]) -> dict[str, dict]:
    return {m["kind"]: m for m in manifests}


def test_the_proxy_runs_beside_the_head_as_a_driver_of_its_raylet():
    docs = proxy_cluster(CFG)
    assert [m["kind"] for m in docs] == ["Secret", "RayCluster", "Service", "NetworkPolicy"]
    cluster = by_kind(docs)["RayCluster"]
    validate(cluster)
    check_gke_tpu_rules(cluster, Topology.parse("v6e", "4x4"), 2)
    pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    head, proxy = pod["containers"]
    assert (head["name"], proxy["name"]) == ("ray-head", "pathways-proxy")
    # The raylet's socket files and the object store are shared with the proxy.
    for path in ("/tmp/ray", "/dev/shm"):
        assert ({m["name"] for m in head["volumeMounts"] if m["mountPath"] == path}
                == {m["name"] for m in proxy["volumeMounts"] if m["mountPath"] == path})
    command = proxy["command"][-1]
    assert "ray health-check --address 127.0.0.1:6379" in command  # waits for the head
    assert f"pathways-ray proxy --address 127.0.0.1:6379 --host 0.0.0.0 --port {PROXY_PORT} " \
           f"--slices v6e-4x4:2" in command
    env = {e["name"]: e for e in proxy["env"]}
    assert env["PATHWAYS_RAY_PROXY_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "tpu-proxy-token", "key": "token"}
    # KubeRay's Secret for authOptions: named as the cluster, key auth_token.
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "tpu",
                                                                  "key": "auth_token"}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert proxy["readinessProbe"]["tcpSocket"]["port"] == PROXY_PORT
    assert "PATHWAYS_RAY_PROXY_TOKEN" not in command  # never on a command line (ps)


def test_the_service_reaches_the_proxy_and_the_policy_admits_only_labelled_pods_there():
    docs = by_kind(proxy_cluster(CFG))
    for kind in ("Secret", "Service", "NetworkPolicy"):
        assert round_trips(docs[kind]), kind
    service = docs["Service"]["spec"]
    assert service["selector"] == {"ray.io/cluster": "tpu", "ray.io/node-type": "head"}
    assert [(p["port"], p["targetPort"]) for p in service["ports"]] == [(PROXY_PORT, PROXY_PORT)]
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == service["selector"]

    def admitted(port: int, labels: dict) -> bool:
        for rule in policy["ingress"]:
            ports = any(p["protocol"] == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
                        for p in rule["ports"])
            peers = "from" not in rule or any(
                all(labels.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items())
                for peer in rule["from"])
            if ports and peers:
                return True
        return False

    notebook, stranger = {CLIENT_LABEL: "tpu"}, {"app": "other"}
    worker = {"ray.io/cluster": "tpu", "ray.io/node-type": "worker"}
    assert admitted(PROXY_PORT, notebook) and admitted(PROXY_PORT, worker)
    assert not admitted(PROXY_PORT, stranger)
    assert not admitted(PROXY_PORT, {CLIENT_LABEL: "another-cluster"})
    for port in (6379, 8265, 10001, 8080, 1, 65535, PROXY_PORT - 1, PROXY_PORT + 1):
        assert admitted(port, stranger), port  # the head's other ports: as without it


def test_the_token_is_fresh_per_render_or_taken_from_a_secret_you_made():
    one, two = (by_kind(proxy_cluster(CFG))["Secret"]["stringData"]["token"] for _ in "ab")
    assert one != two and len(one) >= 40
    docs = proxy_cluster(CFG, ProxyConfig(secret="team-proxy-token", port=8470,
                                          slices=("v6e-4x4:1",)))
    assert "Secret" not in by_kind(docs)
    proxy = by_kind(docs)["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"][1]
    assert "--port 8470 --slices v6e-4x4:1" in proxy["command"][-1]
    assert proxy["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "team-proxy-token"


def test_a_client_pod_has_the_label_the_backend_target_and_the_token():
    pod = client_pod(CFG)
    assert round_trips(pod)
    assert pod["metadata"]["labels"] == {CLIENT_LABEL: "tpu"}
    env = {e["name"]: e.get("value") or e["valueFrom"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["JAX_PLATFORMS"] == "proxy"
    assert env["JAX_BACKEND_TARGET"] == f"grpc://tpu-proxy.default.svc.cluster.local:{PROXY_PORT}"
    assert env["PATHWAYS_RAY_PROXY_TOKEN"]["secretKeyRef"]["name"] == "tpu-proxy-token"


@pytest.mark.parametrize("bad, named", [
    (dict(port=6379), "port=6379"), (dict(port=80), "port=80"),
    (dict(secret="Bad_Name"), "secret='Bad_Name'"), (dict(slices=("v6e 4x4",)), "slices="),
    (dict(memory="8 GB"), "memory='8 GB' is not a Kubernetes quantity"),
])
def test_bad_proxy_settings_are_named(bad, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        ProxyConfig(**bad)


def test_the_cli_renders_the_proxy_and_names_a_bad_port(capsys):
    from pathways_ray.cli.main import main

    base = ["k8s", "render", "cluster", "--name", "tpu", "--accelerator", "v6e",
            "--topology", "4x4", "--slices", "2"]
    assert main([*base, "--proxy"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["Secret", "RayCluster", "Service", "NetworkPolicy"]
    validate(docs[1])
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--proxy", "--proxy-port", "6379"])
    assert exit_.value.code == 2
    assert "port=6379 must be a free port" in capsys.readouterr().err
