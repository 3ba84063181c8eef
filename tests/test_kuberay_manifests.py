"""KubeRay manifests for GKE TPU slices: CRD schemas, GKE TPU rules, errors, samples."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import yaml

from pathways_ray.clusters.topology import Topology
from pathways_ray.kuberay import (
    ClusterConfig,
    SchemaError,
    openai_serve_config,
    ray_cluster,
    ray_job,
    ray_service,
    to_yaml,
    validate,
)
from pathways_ray.kuberay.samples import SAMPLES, render

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "kuberay"

CASES = [  # (accelerator, topology, chips_per_host, slices)
    ("v4", "2x2x1", None, 1), ("v4", "2x2x4", None, 2),
    ("v5e", "1x1", None, 1), ("v5e", "2x4", None, 1), ("v5e", "4x8", None, 3),
    ("v5p", "2x2x1", None, 1), ("v5p", "2x2x2", None, 2), ("v5p", "4x4x4", None, 1),
    ("v6e", "2x2", None, 1), ("v6e", "2x4", None, 1), ("v6e", "2x4", 4, 2),
    ("v6e", "4x4", None, 1), ("v6e", "16x16", None, 4),
    ("tpu7x", "2x2x1", None, 1), ("tpu7x", "4x4x4", None, 2),
]


def worker_group(manifest: dict) -> dict:
    spec = manifest["spec"]
    spec = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
    (group,) = spec["workerGroupSpecs"]
    return group


def cluster_spec(manifest: dict) -> dict:
    spec = manifest["spec"]
    return spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec


def check_gke_tpu_rules(manifest: dict, topo: Topology, slices: int) -> None:
    """What GKE needs of a TPU worker group, and what we promise on top."""
    group = worker_group(manifest)
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    res = container["resources"]
    assert group["numOfHosts"] == topo.num_hosts
    assert group["replicas"] == slices
    assert group["minReplicas"] <= slices <= group["maxReplicas"]
    assert res["requests"]["google.com/tpu"] == res["limits"]["google.com/tpu"] == str(
        topo.chips_per_host)
    assert res["requests"]["cpu"] == res["limits"]["cpu"]
    assert res["requests"]["memory"] == res["limits"]["memory"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": topo.gke_accelerator,
        "cloud.google.com/gke-tpu-topology": topo.name,
    }
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert "readinessProbe" in container and "livenessProbe" in container
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert (ports.get("mxla") == 8081) == (topo.num_hosts > 1 or group["maxReplicas"] > 1)
    spec = cluster_spec(manifest)
    assert spec["authOptions"] == {"mode": "token"}, "Ray token auth stays on"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "google.com/tpu" not in head["resources"]["limits"], "the head is a CPU pod"


@pytest.mark.parametrize("acc,topology,per_host,slices", CASES)
def test_cluster_for_every_generation_and_shape(acc, topology, per_host, slices):
    """RayClusters for each generation, single/multi host and slice, pass the CRD schema
    (defaults applied, unknown fields rejected) and the GKE TPU rules."""
    cfg = ClusterConfig(name="tpu", accelerator=acc, topology=topology,
                        chips_per_host=per_host, num_slices=slices)
    manifest = ray_cluster(cfg)
    validate(manifest)
    check_gke_tpu_rules(manifest, cfg.tpu, slices)
    # The YAML round-trips to the same object.
    assert yaml.safe_load(to_yaml(manifest)) == manifest


def test_v6e_2x4_is_one_8_chip_host_by_default():
    """v5e/v6e 2x4 renders as one ct6e-standard-8t host unless asked for two 4-chip hosts."""
    one = worker_group(ray_cluster(ClusterConfig(name="a", accelerator="v6e", topology="2x4")))
    assert one["numOfHosts"] == 1
    assert one["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "8"
    two = worker_group(ray_cluster(ClusterConfig(name="a", accelerator="v6e", topology="2x4",
                                                 chips_per_host=4)))
    assert two["numOfHosts"] == 2


def test_autoscaling_between_min_and_max_slices():
    """min/max slices become min/max replicas and turn on the in-tree autoscaler."""
    m = ray_cluster(ClusterConfig(name="a", accelerator="v5p", topology="2x2x2", num_slices=2,
                                  min_slices=1, max_slices=4))
    g = worker_group(m)
    assert (g["minReplicas"], g["replicas"], g["maxReplicas"]) == (1, 2, 4)
    assert m["spec"]["enableInTreeAutoscaling"] is True
    fixed = ray_cluster(ClusterConfig(name="a", accelerator="v5p", topology="2x2x2"))
    assert "enableInTreeAutoscaling" not in fixed["spec"]


def test_ray_job_runs_an_example_script():
    """The RayJob runs the same entrypoint as `ray job submit --`, then cleans up."""
    cfg = ClusterConfig(name="train", accelerator="v6e", topology="4x4")
    m = ray_job(cfg, "python examples/train_jax_lm.py",
                runtime_env={"working_dir": "https://example.com/code.zip", "pip": ["x==1"]})
    assert m["spec"]["entrypoint"] == "python examples/train_jax_lm.py"
    assert yaml.safe_load(m["spec"]["runtimeEnvYAML"]) == {
        "working_dir": "https://example.com/code.zip", "pip": ["x==1"]}
    assert m["spec"]["shutdownAfterJobFinishes"] is True
    check_gke_tpu_rules(m, cfg.tpu, 1)
    # Defaults the API server would apply are applied by validate().
    assert validate(m)["spec"]["submissionMode"] == "K8sJobMode"


def test_ray_service_serves_the_openai_app_on_a_v6e_4x4_slice():
    """16-way tensor parallelism over 4 hosts x 4 chips, expert parallel, 8192 tokens."""
    cfg = ClusterConfig(name="llm", accelerator="v6e", topology="4x4")
    m = ray_service(cfg, openai_serve_config(cfg, model_id="Qwen/Qwen3-30B-A3B"))
    serve = yaml.safe_load(m["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    (llm,) = app["args"]["llm_configs"]
    assert llm["engine_kwargs"] == {"tensor_parallel_size": 16, "enable_expert_parallel": True,
                                    "max_model_len": 8192}
    assert llm["accelerator_type"] == "TPU-V6E"
    assert llm["accelerator_config"] == {"kind": "tpu", "topology": "4x4"}
    check_gke_tpu_rules(m, cfg.tpu, 1)
    assert worker_group(m)["numOfHosts"] == 4
    head_ports = m["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["ports"]
    assert {"containerPort": 8000, "name": "serve"} in head_ports


@pytest.mark.parametrize(
    "kwargs,field_text",
    [
        (dict(accelerator="v9", topology="4x4"), "accelerator='v9'"),
        (dict(accelerator="v6e", topology="2x2x2"), "topology='2x2x2'"),
        (dict(accelerator="v5p", topology="4x4"), "topology='4x4'"),
        (dict(accelerator="v6e", topology="4x4", num_slices=0), "num_slices=0"),
        (dict(accelerator="v6e", topology="4x4", min_slices=3, num_slices=2), "min_slices=3"),
        (dict(accelerator="v6e", topology="4x4", name="Tpu_Cluster"), "name='Tpu_Cluster'"),
        (dict(accelerator="v6e", topology="4x4", name="1tpu"), "DNS-1035"),
        (dict(accelerator="v6e", topology="4x4", namespace="Prod"), "namespace='Prod'"),
        (dict(accelerator="v6e", topology="4x4", head_memory="lots"), "head_memory='lots'"),
        (dict(accelerator="v6e", topology="4x4", ray_version="latest"), "ray_version='latest'"),
        (dict(accelerator="v6e", topology="4x4", compilation_cache="/tmp/c"),
         "compilation_cache='/tmp/c'"),
        (dict(accelerator="v6e", topology="4x4", compilation_cache="pvc:Bad_Name"),
         "compilation_cache='pvc:Bad_Name'"),
    ],
)
def test_invalid_requests_name_the_field(kwargs, field_text):
    """Bad arguments raise ValueError naming the field before any YAML exists."""
    kwargs = {"name": "tpu", **kwargs}
    with pytest.raises(ValueError) as exc:
        ray_cluster(ClusterConfig(**kwargs))
    assert field_text in str(exc.value)


def test_a_team_compilation_cache_reaches_every_pod():
    """A bucket sets the cache variable on head and TPU workers; a volume claim is also
    mounted where the variable points. The manifests still pass the CRD schema."""
    from pathways_ray.config import CACHE_ENV

    def pods(m):
        spec = m["spec"]
        yield spec["headGroupSpec"]["template"]["spec"]
        for g in spec["workerGroupSpecs"]:
            yield g["template"]["spec"]

    bucket = ray_cluster(ClusterConfig(name="c", accelerator="v6e", topology="4x4",
                                       compilation_cache="gs://team-bucket/xla"))
    for pod in pods(bucket):
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        assert env[CACHE_ENV] == "gs://team-bucket/xla"
    shared = ray_cluster(ClusterConfig(name="c", accelerator="v6e", topology="4x4",
                                       compilation_cache="pvc:xla-cache"))
    for pod in pods(shared):
        c = pod["containers"][0]
        env = {e["name"]: e["value"] for e in c["env"]}
        mount = next(m for m in c["volumeMounts"] if m["name"] == "xla-cache")
        assert env[CACHE_ENV] == mount["mountPath"]
        assert {"name": "xla-cache", "persistentVolumeClaim": {"claimName": "xla-cache"}} in (
            pod["volumes"])
    validate(shared)
    validate(bucket)


def test_invalid_job_and_service_arguments():
    """Job and service arguments are checked too, with the fix in the message."""
    cfg = ClusterConfig(name="tpu", accelerator="v6e", topology="4x4")
    with pytest.raises(ValueError, match="entrypoint=''"):
        ray_job(cfg, "")
    with pytest.raises(ValueError, match="working_dir='.'.*remote URI"):
        ray_job(cfg, "python x.py", runtime_env={"working_dir": "."})
    with pytest.raises(ValueError, match="model_id=''"):
        openai_serve_config(cfg, model_id="")
    with pytest.raises(ValueError, match="applications"):
        ray_service(cfg, {})


# ---- the validator itself ------------------------------------------------------------
def _public_samples():
    if not (SHARED / "samples").is_dir():
        pytest.skip(f"{SHARED}/samples not present")
    for path in sorted((SHARED / "samples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("apiVersion") == "ray.io/v1":
                yield path.name, doc


def test_public_gke_samples_pass_the_validator():
    """KubeRay's own GKE TPU samples validate: the checker is not stricter than the API."""
    names = [name for name, doc in _public_samples() if validate(doc)]
    assert len(names) >= 8


def test_validator_rejects_what_the_api_server_would_drop_or_refuse():
    """Unknown fields, wrong types, missing required fields and CEL-guarded fields fail,
    each error naming its path."""
    good = ray_cluster(ClusterConfig(name="tpu", accelerator="v6e", topology="4x4"))

    def broken(edit):
        m = copy.deepcopy(good)
        edit(m)
        with pytest.raises(SchemaError) as exc:
            validate(m)
        return str(exc.value)

    text = broken(lambda m: m["spec"]["workerGroupSpecs"][0].update(numHosts=4))
    assert "RayCluster.spec.workerGroupSpecs[0].numHosts: unknown field" in text
    text = broken(lambda m: m["spec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"][0].update(resource={}))
    assert "containers[0].resource: unknown field" in text
    text = broken(lambda m: m["spec"]["workerGroupSpecs"][0].update(replicas="2"))
    assert "replicas: expected integer" in text
    text = broken(lambda m: m["spec"]["workerGroupSpecs"][0].pop("groupName"))
    assert "missing required field 'groupName'" in text
    text = broken(lambda m: m["spec"].update(managedBy="ray.io/kuberay-operator"))
    assert "CEL" in text
    text = broken(lambda m: m["spec"]["authOptions"].update(mode="password"))
    assert "'password' is not one of ['disabled', 'token']" in text
    text = broken(lambda m: m["metadata"].update(name="Not_DNS"))
    assert "metadata.name" in text
    text = broken(lambda m: m.update(apiVersion="ray.io/v1alpha1"))
    assert "apiVersion" in text


def test_validator_applies_schema_defaults():
    """Defaults come from the CRD, as the API server applies them."""
    m = ray_cluster(ClusterConfig(name="tpu", accelerator="v6e", topology="4x4"))
    del m["spec"]["workerGroupSpecs"][0]["numOfHosts"]
    out = validate(m)
    assert out["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 1
    assert "numOfHosts" not in m["spec"]["workerGroupSpecs"][0], "input is not modified"


def test_bundled_schemas_match_kuberay_crds():
    """The schemas in the package are exactly the v1 schemas of the KubeRay v1.7 CRDs."""
    if not (SHARED / "crds").is_dir():
        pytest.skip(f"{SHARED}/crds not present")
    import importlib.util

    spec = importlib.util.spec_from_file_location("bundle", REPO / "scripts" / "bundle_crds.py")
    bundle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle)
    for kind, name in bundle.KINDS.items():
        packaged = json.loads(gzip.decompress(
            (REPO / "kuberay" / "crds" / f"{kind}.v1.json.gz").read_bytes()))
        assert packaged == bundle.v1_schema(SHARED / "crds" / name), kind


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_checked_in_samples_are_what_the_generators_render(name):
    """kuberay/samples/ never drifts from the generators (re-render with
    `python -m pathways_ray.kuberay.samples`)."""
    path = REPO / "kuberay" / "samples" / name
    assert path.read_text() == render(name), f"{name} is stale; re-render the samples"
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["apiVersion"] == "ray.io/v1":
            validate(doc)
        else:  # the proxy's Secret, Service, NetworkPolicy and client Pod
            from tests.test_kuberay_proxy import round_trips

            assert round_trips(doc), doc["kind"]


def test_job_entrypoint_runs_the_example_on_the_jobs_slices():
    """The default RayJob command asks the example for exactly the cluster's slices."""
    import argparse
    import shlex

    from pathways_ray.kuberay import example_entrypoint
    from pathways_ray.trainers.cli import add_slice_args, slice_topology

    cfg = ClusterConfig(name="t", accelerator="v6e", topology="2x4", chips_per_host=4,
                        num_slices=2)
    cmd = shlex.split(example_entrypoint(cfg))
    assert cmd[:2] == ["python", "examples/train_jax_lm.py"]
    ap = argparse.ArgumentParser()
    add_slice_args(ap, topology="2x2", slices=1, name="x")
    args = ap.parse_args(cmd[2:])
    assert (slice_topology(args), args.slices) == (cfg.tpu, 2)
    assert cfg.tpu.num_hosts == 2


def test_every_pod_runs_ray_serve_in_its_high_throughput_mode_unless_told_otherwise():
    """Head and TPU worker pods get the env every pathways-ray node has (Ray Serve's
    high-throughput mode, as on the emulated fleet); ``env=`` overrides a key."""
    from pathways_ray.clusters.host_plan import NODE_ENV

    def envs(m):
        spec = m["spec"]
        for pod in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            yield {e["name"]: e["value"] for e in pod["template"]["spec"]["containers"][0]["env"]}

    cfg = dict(name="c", accelerator="v6e", topology="4x4")
    for env in envs(ray_cluster(ClusterConfig(**cfg))):
        assert {k: env[k] for k in NODE_ENV} == NODE_ENV
    told = ray_cluster(ClusterConfig(**cfg, env={"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}))
    for env in envs(told):
        assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"


@pytest.mark.parametrize("kind", ["cluster", "job", "service"])
def test_the_cli_renders_a_team_compilation_cache(kind, capsys):
    """`pathways-ray k8s render KIND --compilation-cache gs://…|pvc:…` reaches every pod
    and passes the CRD schemas; a bad value fails with ClusterConfig's own error."""
    from pathways_ray.cli.main import main
    from pathways_ray.config import CACHE_ENV

    base = ["k8s", "render", kind, "--name", "c", "--accelerator", "v6e", "--topology", "4x4"]
    if kind == "service":
        base += ["--model", "Qwen/Qwen3-30B-A3B"]
    for cache in ("gs://team-bucket/xla", "pvc:xla-cache"):
        assert main([*base, "--compilation-cache", cache]) == 0
        doc = yaml.safe_load(capsys.readouterr().out)
        validate(doc)
        text = json.dumps(doc)
        assert f'"name": "{CACHE_ENV}"' in text
        assert (cache in text) if cache.startswith("gs://") else '"claimName": "xla-cache"' in text
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--compilation-cache", "/tmp/c"])
    assert exit_.value.code == 2
    assert "compilation_cache='/tmp/c' must be a bucket path" in capsys.readouterr().err


def test_every_subcommand_names_the_local_fleet_the_same_way():
    """Where `--name` names the fleet (up, status, chaos, down) it is `--name`; every other
    subcommand that can reach a local fleet takes `--fleet`, and no `--fleet-name`."""
    import argparse

    from pathways_ray.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    fleet_is_the_subject = {"up", "status", "chaos", "down"}
    seen = {}
    for name, parser in sub.choices.items():
        flags = {o for a in parser._actions for o in a.option_strings}
        seen[name] = flags
        assert "--fleet-name" not in flags, name
        if name not in fleet_is_the_subject and "--address" in flags:
            assert "--fleet" in flags, f"`pathways-ray {name}` reaches a fleet without --fleet"
            help_text = next(a.help for a in parser._actions if "--fleet" in a.option_strings)
            assert "pathways-ray up --name" in help_text, help_text
    assert {"service", "serve"} <= {n for n, f in seen.items() if "--fleet" in f}
