"""``pathways-ray k8s``: render KubeRay manifests for GKE TPU slices, and submit them.

    pathways-ray k8s render cluster --name tpu --accelerator v6e --topology 4x4 > c.yaml
    pathways-ray k8s render job --name train --accelerator v6e --topology 4x4 \\
        --entrypoint "python examples/train_jax_lm.py" --working-dir https://…/main.zip
    pathways-ray k8s render service --name llm --accelerator v6e --topology 4x4 --model Qwen/…
    pathways-ray k8s submit -f c.yaml --wait
    pathways-ray k8s status [cluster|job|service] [NAME]
    pathways-ray k8s delete cluster tpu
"""

from __future__ import annotations

import argparse
import sys

import yaml

KIND_ALIASES = {"cluster": "RayCluster", "job": "RayJob", "service": "RayService",
                "raycluster": "RayCluster", "rayjob": "RayJob", "rayservice": "RayService"}


def _kind(text: str) -> str:
    kind = KIND_ALIASES.get(text.lower())
    if kind is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a KubeRay kind; use cluster, job or service")
    return kind


def _key_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} must look like KEY=VALUE")
    k, v = text.split("=", 1)
    return k, v


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="resource name (a DNS-1035 label)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--accelerator", required=True,
                   help="TPU generation (v4, v5e, v5p, v6e, tpu7x) or pod type (v6e-16)")
    p.add_argument("--topology", default=None, help="slice shape, e.g. 4x4 or 2x2x2")
    p.add_argument("--chips-per-host", type=int, default=None,
                   help="v5e/v6e 2x4 only: 4 for two 4-chip hosts (default: one 8-chip host)")
    p.add_argument("--slices", type=int, default=1, help="number of slices (worker replicas)")
    p.add_argument("--min-slices", type=int, default=None, help="autoscaling lower bound")
    p.add_argument("--max-slices", type=int, default=None, help="autoscaling upper bound")
    p.add_argument("--image", default=None, help="container image with Ray and pathways-ray")
    p.add_argument("--ray-version", default=None)
    p.add_argument("--head-cpu", default="8")
    p.add_argument("--head-memory", default="32Gi")
    p.add_argument("--worker-cpu", default=None, help="default: sized to the GKE machine type")
    p.add_argument("--worker-memory", default=None, help="default: sized to the machine type")
    p.add_argument("--service-account", default=None)
    p.add_argument("--env", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for every container (repeatable)")
    p.add_argument("--compilation-cache", default=None, metavar="gs://BUCKET/DIR | pvc:CLAIM",
                   help="compiled programs shared by every host and job: a bucket path (the "
                        "image needs pathways-ray[gcs]) or a ReadWriteMany volume claim, "
                        "mounted at /xla-cache (default: each pod's local disk)")


def _config(args):
    from .manifests import DEFAULT_IMAGE, DEFAULT_RAY_VERSION, ClusterConfig

    return ClusterConfig(
        name=args.name, namespace=args.namespace, accelerator=args.accelerator,
        topology=args.topology, chips_per_host=args.chips_per_host, num_slices=args.slices,
        min_slices=args.min_slices, max_slices=args.max_slices,
        image=args.image or DEFAULT_IMAGE, ray_version=args.ray_version or DEFAULT_RAY_VERSION,
        head_cpu=args.head_cpu, head_memory=args.head_memory, worker_cpu=args.worker_cpu,
        worker_memory=args.worker_memory, env=dict(args.env),
        service_account=args.service_account, compilation_cache=args.compilation_cache,
    )


def _client(args):
    from .client import KubeRayClient

    if args.server:
        return KubeRayClient.for_host(args.server, token=args.token,
                                      verify_ssl=not args.insecure,
                                      default_namespace=args.namespace)
    return KubeRayClient.from_kubeconfig(args.kubeconfig, args.context,
                                         default_namespace=args.namespace)


def _api_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default="default")
    p.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG or ~/.kube/config")
    p.add_argument("--context", default=None)
    p.add_argument("--server", default=None, help="API server URL instead of a kubeconfig")
    p.add_argument("--token", default=None, help="bearer token, with --server")
    p.add_argument("--insecure", action="store_true", help="skip TLS verification (--server)")


def register(sub) -> dict:
    """Add ``k8s`` to the ``pathways-ray`` command line; returns its handler."""
    k8s = sub.add_parser("k8s", help="render and submit KubeRay manifests for GKE TPU slices",
                         description=__doc__.split("\n\n")[0])
    ks = k8s.add_subparsers(dest="k8s_command", required=True, metavar="ACTION")

    render = ks.add_parser("render", help="print a RayCluster, RayJob or RayService as YAML")
    rs = render.add_subparsers(dest="kind", required=True, metavar="KIND")
    c = rs.add_parser("cluster", help="a RayCluster with a TPU worker group")
    _cluster_flags(c)
    c.add_argument("--proxy", action="store_true",
                   help="serve unmodified JAX (JAX_PLATFORMS=proxy) from the head: adds the "
                        "IFRT proxy beside it, its token Secret, a Service and a "
                        "NetworkPolicy admitting pods labelled pathways-ray/proxy-client=NAME")
    c.add_argument("--proxy-port", type=int, default=None, help="default 29000")
    c.add_argument("--proxy-slices", nargs="+", default=(), metavar="SHAPE[:COUNT]",
                   help="what each proxy session gets (default: every slice of the cluster)")
    c.add_argument("--proxy-secret", default=None,
                   help="an existing Secret with the proxy token under key 'token' "
                        "(default: one is rendered with a fresh token)")
    j = rs.add_parser("job", help="a RayJob running a training script on a TPU cluster")
    _cluster_flags(j)
    j.add_argument("--entrypoint", default=None,
                   help="the command, as for `ray job submit --` (default: the JAX LM example "
                        "on the slices of --accelerator/--topology/--slices)")
    j.add_argument("--working-dir", default=None,
                   help="remote URI of the code (https://…zip, gs://…) for runtime_env")
    j.add_argument("--pip", action="append", default=[], help="pip package for runtime_env")
    j.add_argument("--ttl-seconds", type=int, default=600,
                   help="delete the cluster this long after the job finishes")
    s = rs.add_parser("service", help="a RayService serving an OpenAI-compatible LLM")
    _cluster_flags(s)
    s.add_argument("--model", required=True, help="model id, e.g. Qwen/Qwen3-30B-A3B")
    s.add_argument("--model-source", default=None, help="where to load it from, if not the id")
    s.add_argument("--max-model-len", type=int, default=8192)
    s.add_argument("--no-expert-parallel", action="store_true")

    submit = ks.add_parser("submit", help="create the resources of a YAML file")
    submit.add_argument("-f", "--file", required=True, help="manifest file, or - for stdin")
    submit.add_argument("--wait", action="store_true", help="wait until ready / succeeded")
    submit.add_argument("--timeout", type=float, default=900.0, help="seconds, with --wait")
    _api_flags(submit)

    status = ks.add_parser("status", help="list resources, or show one")
    status.add_argument("kind", nargs="?", type=_kind, default=None,
                        help="cluster, job or service (default: all)")
    status.add_argument("name", nargs="?", default=None)
    _api_flags(status)

    delete = ks.add_parser("delete", help="delete a resource")
    delete.add_argument("kind", type=_kind)
    delete.add_argument("name")
    _api_flags(delete)
    return {"k8s": run}


def run(args) -> int:
    from .client import KubeRayError
    from .manifests import (
        example_entrypoint,
        openai_serve_config,
        ray_cluster,
        ray_job,
        ray_service,
        to_yaml,
    )

    if args.k8s_command == "render":
        cfg = _config(args)
        if args.kind == "cluster" and (args.proxy or args.proxy_port or args.proxy_slices
                                       or args.proxy_secret):
            from .proxy import PROXY_PORT, ProxyConfig, proxy_cluster

            proxy = ProxyConfig(port=args.proxy_port or PROXY_PORT,
                                slices=tuple(args.proxy_slices), secret=args.proxy_secret)
            sys.stdout.write(to_yaml(*proxy_cluster(cfg, proxy)))
            return 0
        if args.kind == "cluster":
            manifest = ray_cluster(cfg)
        elif args.kind == "job":
            runtime_env = {}
            if args.working_dir:
                runtime_env["working_dir"] = args.working_dir
            if args.pip:
                runtime_env["pip"] = args.pip
            entrypoint = args.entrypoint or example_entrypoint(cfg)
            manifest = ray_job(cfg, entrypoint, runtime_env=runtime_env or None,
                               ttl_seconds_after_finished=args.ttl_seconds)
        else:
            manifest = ray_service(cfg, openai_serve_config(
                cfg, model_id=args.model, model_source=args.model_source,
                max_model_len=args.max_model_len,
                enable_expert_parallel=not args.no_expert_parallel))
        sys.stdout.write(to_yaml(manifest))
        return 0

    try:
        client = _client(args)
        if args.k8s_command == "submit":
            text = sys.stdin.read() if args.file == "-" else open(args.file).read()
            manifests = [m for m in yaml.safe_load_all(text) if m]
            others = sorted({str(m.get("kind")) for m in manifests
                             if m.get("kind") not in KIND_ALIASES.values()})
            if others:  # before creating anything: no half-made cluster
                print(f"error: {args.file} has {', '.join(others)}: `k8s submit` creates "
                      f"RayCluster, RayJob and RayService only; apply the file with "
                      f"`kubectl apply -f {args.file}`", file=sys.stderr)
                return 2
            for manifest in manifests:
                obj = client.create(manifest, args.namespace)
                print(f"created {obj['kind']} {obj['metadata']['namespace']}/"
                      f"{obj['metadata']['name']}")
                if args.wait:
                    client.wait_ready(obj["kind"], obj["metadata"]["name"],
                                      obj["metadata"]["namespace"], timeout_s=args.timeout)
                    print(f"{obj['kind']} {obj['metadata']['name']} is ready")
        elif args.k8s_command == "status":
            kinds = [args.kind] if args.kind else ["RayCluster", "RayJob", "RayService"]
            if args.name:
                obj = client.get(kinds[0], args.name)
                print(yaml.safe_dump({"metadata": {"name": obj["metadata"]["name"]},
                                      "status": obj.get("status") or {}}, sort_keys=False))
            else:
                print(f"{'KIND':<11} {'NAME':<30} STATE")
                for kind in kinds:
                    for obj in client.list(kind):
                        print(f"{kind:<11} {obj['metadata']['name']:<30} {_state(obj)}")
        elif args.k8s_command == "delete":
            client.delete(args.kind, args.name)
            print(f"deleted {args.kind} {args.namespace}/{args.name}")
    except KubeRayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _state(obj: dict) -> str:
    status = obj.get("status") or {}
    return (status.get("state") or status.get("jobStatus") or status.get("serviceStatus")
            or "pending")
