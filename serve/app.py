"""Ray Serve LLM on TPU slices: the config, the app, and running it with deadlines.

Everything that serves is Ray Serve LLM's (``LLMConfig``, ``build_openai_app``,
its OpenAI ingress and ``LLMServer``) and vLLM's; this module only decides how
a slice becomes a replica and waits for it with a deadline.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import ray

from pathways_ray.config import base_dir
from pathways_ray.errors import PathwaysError
from pathways_ray.serve.plan import accelerator_type, llm_config_dict, replica_range

__all__ = [
    "DIRECT_STREAMING_ENV",
    "cpu_engine_env",
    "detect_platform",
    "llm_config",
    "openai_app",
    "serve_llm",
    "shutdown_llm",
    "tpu_engine_env",
]

logger = logging.getLogger(__name__)

#: Ray Serve LLM's direct streaming: each LLM replica serves HTTP itself (vLLM's own
#: OpenAI server in the replica) behind HAProxy, with no ingress hop. Set in the driver
#: before Ray Serve LLM is imported and on every node (``LocalFleet`` takes it from the
#: env it starts in, KubeRay from ``ClusterConfig.env``), over ``host_plan.NODE_ENV``'s
#: ``RAY_SERVE_ENABLE_DIRECT_INGRESS=0``. HAProxy sends a request again, to another
#: replica, when its replica closed the connection without answering (the failover:
#: a lost replica's non-streaming requests; a stream cut after its first token ends
#: with the connection, not an error event). Fewer CPU-s per token than pathways-ray's
#: failover ingress, but one config per app.
DIRECT_STREAMING_ENV = {
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
}


def _serve_llm_module():
    """``ray.serve.llm``, imported without letting it take over this process's logging
    (its import sets the root logger to INFO with its own handler, which turns every
    library's INFO lines, e.g. each HTTP request of the openai client, into output)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        import ray.serve.llm
    except ImportError as e:
        raise PathwaysError(
            f"serving needs Ray Serve LLM and vLLM ({e}); install them with `./run.sh test` "
            f"once, or `pip install -e '.[serve]' && pip install --no-deps -r "
            f"serve/requirements-nodeps.txt` (on TPU hosts: serve/images/tpu.Dockerfile)"
        ) from None
    finally:
        root.setLevel(level)
        root.handlers = handlers
    return ray.serve.llm


def cpu_engine_env(replicas: int = 1) -> dict[str, str]:
    """Env for vLLM's CPU engine on an emulated host (each fact cost a failed start):
    OpenMP binding off (hosts share the cores; ``all`` is not a value it takes), a
    bounded KV cache, and vLLM's caches and ZMQ sockets under the pathways-ray directory
    instead of ``/tmp`` and ``~`` (the socket directory must exist).

    The engine's OpenMP threads: this machine's cores shared among the app's
    ``replicas`` (emulated hosts share the machine). Ray gives an actor's processes
    ``OMP_NUM_THREADS=<its num_cpus>``, 1 for a replica, which vLLM keeps: one engine
    computed on one core where vLLM's own server uses them all. More threads than
    cores is worse: two engines of 2 spinning threads each on 2 cores served 3-8x
    fewer tokens/s than one alone (``benchmarks/serve_failover.py``)."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r} must be a positive int (the app's most "
                         f"replicas, which share this machine's cores)")
    root = base_dir() / "vllm"
    rpc = root / "rpc"
    rpc.mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // replicas)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(root / "cache"),
        "VLLM_RPC_BASE_PATH": str(rpc),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def tpu_engine_env() -> dict[str, str]:
    """Env for vLLM on TPU chips: its XLA compilation cache in the fleet's persistent
    compilation cache (``$PATHWAYS_RAY_COMPILATION_CACHE_DIR``, shared storage on a
    real cluster), so a replica that restarts or scales out skips recompiling."""
    from pathways_ray.config import default_compilation_cache_dir

    return {"VLLM_XLA_CACHE_PATH": default_compilation_cache_dir().rstrip("/") + "/vllm"}


def detect_platform(accelerator: str = "v6e", timeout_s: float = 60.0) -> str:
    """``"tpu"`` or ``"cpu"`` (emulated), asked of a TPU host of the connected cluster."""
    from pathways_ray.chips.chip_worker import detect_platform as on_host

    accel = accelerator_type(accelerator)
    ref = ray.remote(on_host).options(
        num_cpus=0, label_selector={"ray.io/accelerator-type": accel}).remote()
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
        raise PathwaysError(
            f"no {accel} host answered within timeout_s={timeout_s:g}s; is a TPU slice of "
            f"that generation in the cluster? (`pathways-ray status`)")
    return ray.get(ref)


def llm_config(model: str, *, platform: str = "tpu", model_source: str | None = None,
               env_vars: Mapping[str, str] | None = None, **plan: Any):
    """A Ray Serve LLM ``LLMConfig`` serving ``model`` with one replica per TPU slice.

    ``llm_config("Qwen/Qwen3-30B-A3B", accelerator="v6e", topology="4x4")`` is the
    v6e 4x4 replica with 16-way tensor parallelism, expert parallelism and 8192
    tokens of context. ``model="smollm2"`` is the small model bundled for the
    emulated fleet; ``platform="cpu"`` runs vLLM's CPU engine there. The other
    keywords are :func:`~pathways_ray.serve.plan.llm_config_dict`'s.
    """
    LLMConfig = _serve_llm_module().LLMConfig
    from pathways_ray.serve.models import resolve_model

    model_id, bundled_source = resolve_model(model)
    # The engines of the app's most replicas share this machine's cores.
    env = (cpu_engine_env(replica_range(plan.get("num_slices", 1))[1])
           if platform == "cpu" else tpu_engine_env())
    env.update(env_vars or {})
    # A model in a local directory needs no per-node download tasks (serve/node_init.py).
    callbacks = {"callback_class": "pathways_ray.serve.node_init.SkipLocalModelDownload"}
    return LLMConfig(**llm_config_dict(model_id, platform=platform,
                                       model_source=model_source or bundled_source,
                                       env_vars=env, **plan), callback_config=callbacks)


def openai_app(*configs, failover: bool = True):
    """Ray Serve LLM's OpenAI-compatible app (``/v1/models``, ``/v1/chat/completions``,
    ``/v1/completions``) over one or more ``LLMConfig``s (one endpoint routing by
    ``model``). ``failover`` (default): :mod:`pathways_ray.serve.failover`'s ingress
    and replica class (a request whose replica is lost before its first token is sent
    again, ~2 s after the loss; a stream cut after it ends with an error event) for
    every config that names no ``server_cls`` of its own; ``False``: Ray Serve LLM's
    own ``OpenAiIngress`` and ``LLMServer``. Where Ray Serve LLM's direct streaming
    is on (:data:`DIRECT_STREAMING_ENV` in this process and on every node), its
    ``LLMServer`` is the ingress, behind HAProxy, for one config; ``failover`` then
    checks that HAProxy sends a lost replica's requests again."""
    build_openai_app = _serve_llm_module().build_openai_app

    if not configs:
        raise ValueError("openai_app() needs at least one LLMConfig (see llm_config(...))")
    if direct_streaming():
        # The LLM replica is the ingress, behind HAProxy: no ingress of ours to place;
        # HAProxy's retries are the failover.
        retry_on = os.environ.get("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure").split()
        if failover and "empty-response" not in retry_on:
            raise ValueError(
                f"failover=True with Ray Serve LLM's direct streaming needs HAProxy to send "
                f"again a request whose replica closed without answering: "
                f"RAY_SERVE_HAPROXY_RETRY_ON={' '.join(retry_on)!r} lacks 'empty-response'; "
                f"start the driver and the nodes with pathways_ray.serve."
                f"DIRECT_STREAMING_ENV, or pass failover=False")
        return build_openai_app({"llm_configs": list(configs)})
    args: dict[str, Any] = {"llm_configs": list(configs),
                            "ingress_deployment_config": ingress_placement()}
    if failover:
        from pathways_ray.serve.failover import FailoverIngress, KeepaliveLLMServer

        args["llm_configs"] = [c if c.server_cls else c.model_copy(
            update={"server_cls": KeepaliveLLMServer}) for c in configs]
        args["ingress_cls_config"] = {"ingress_cls": FailoverIngress}
    return build_openai_app(args)


def direct_streaming() -> bool:
    """Whether Ray Serve LLM builds direct-streaming apps in this process: its switch
    (``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1``) is read once, when Ray Serve LLM is
    first imported, so set it before."""
    _serve_llm_module()
    from ray.llm._internal.serve import constants

    return bool(constants.RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING)


def ingress_placement() -> dict[str, Any]:
    """The ingress off the TPU hosts: on one, it would die with the host, taking
    every model's requests with it (Serve starts it again, elsewhere, seconds
    later). Any node without a TPU accelerator type label takes it: the head, or a
    CPU worker group on GKE."""
    from pathways_ray.clusters.topology import GENERATIONS

    tpus = ",".join(sorted({g.accelerator_type for g in GENERATIONS.values()}))
    return {"ray_actor_options": {"label_selector": {"ray.io/accelerator-type":
                                                     f"!in({tpus})"}}}


def route_prefix(name: str) -> str:
    """Where app ``name`` answers: ``/`` for the default app ``llm`` (base URL
    ``http://host:port/v1``), ``/<name>`` for any other, so that several apps share
    the cluster's one HTTP proxy."""
    return "/" if name == "llm" else f"/{name}"


def serve_llm(*configs, name: str = "llm", host: str = "127.0.0.1", port: int = 8000,
              timeout_s: float = 900.0, progress=None, failover: bool = True) -> str:
    """Deploy the OpenAI app for ``configs`` on the connected cluster, wait until it is
    RUNNING, and return its base URL (``http://host:port/v1``).

    One HTTP proxy on the head node (emulated hosts share one IP, so a proxy per
    node would fight over the port). Raises ``PathwaysError`` with Serve's own
    message if a replica fails to start or the app is not up within ``timeout_s``.
    """
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        # Serve's driver-side logger prints each deployment's options at INFO.
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    serve.run_many([serve.RunTarget(openai_app(*configs, failover=failover), name=name,
                                    route_prefix=route_prefix(name))],
                   wait_for_ingress_deployment_creation=False,
                   wait_for_applications_running=False)
    t0 = time.monotonic()
    last = None
    while True:
        app = serve.status().applications.get(name)
        status = app.status if app else None
        if status != last and progress:
            progress(f"app {name}: {status}", time.monotonic() - t0)
        last = status
        if status == ApplicationStatus.RUNNING:
            return f"http://{host}:{port}{route_prefix(name).rstrip('/')}/v1"
        if status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
            detail = "; ".join(f"{d}: {s.message}" for d, s in app.deployments.items()
                               if s.message) or app.message
            _delete_quietly(name)
            raise PathwaysError(f"Serve app {name!r} is {status.value}: {detail}")
        if time.monotonic() - t0 > timeout_s:
            detail = app.message if app else "not created"
            _delete_quietly(name)
            raise PathwaysError(
                f"Serve app {name!r} not RUNNING after timeout_s={timeout_s:g}s (status "
                f"{status}, {detail}); a first start converts the model and loads vLLM, "
                f"~1-2 min on 2 cores")
        time.sleep(1.0)


def _delete_quietly(name: str) -> None:
    """A failed app would retry its replicas forever, holding slices: delete it."""
    try:
        shutdown_llm(name, timeout_s=60.0)
    except Exception as e:  # the caller's error is the one to report
        logger.warning("could not delete Serve app %r: %s", name, e)


def shutdown_llm(name: str | None = "llm", timeout_s: float = 120.0) -> None:
    """Delete the app, releasing its slices (``name=None`` stops Serve itself, with
    every app on the cluster)."""
    from ray import serve

    if name is None:
        serve.shutdown()
        return
    serve.delete(name, _blocking=False)
    t0 = time.monotonic()
    while name in serve.status().applications:
        if time.monotonic() - t0 > timeout_s:
            raise PathwaysError(f"Serve app {name!r} still deleting after timeout_s="
                                f"{timeout_s:g}s")
        time.sleep(0.5)
