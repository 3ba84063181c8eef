"""A TPU slice, turned into a Ray Serve LLM config. Pure: no Ray, no vLLM.

One replica owns one whole slice. On TPUs the engine shards the model over
every chip of the slice (``tensor_parallel_size`` = chips) and Ray Serve LLM
reserves the slice with a ``SlicePlacementGroup`` from the ``accelerator_type``
and the topology in ``accelerator_config``. Autoscaling between ``min_slices``
and ``max_slices`` replicas adds and removes whole slices.

On the emulated fleet (``platform="cpu"``) the engine is vLLM's CPU build,
which runs its workers as local processes (vLLM has no Ray executor on CPU),
so a replica is one engine on one emulated TPU host. The replica still holds
the slice's chips: its placement group asks for the host's ``TPU`` chips and
the slice's ``TPU-<pod>-head`` resource, as a real slice reservation does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pathways_ray.clusters.topology import Topology, generation

__all__ = ["ENGINE_ARG_DEFAULTS", "PLATFORMS", "accelerator_type", "llm_config_dict",
           "openai_serve_config", "replica_range", "slice_topology"]

PLATFORMS = ("tpu", "cpu")

# Engine arguments per platform: vLLM's CPU engine runs eager (torch.compile adds
# minutes to a start on 2 cores) and in float32: in bfloat16 the greedy output depends
# on which kernels the CPU has (with AMX, SmolLM2 answered "What is the capital of
# France?" with "L'Étoile, la Marseillaise, ..."; float32 gives Hugging Face's own
# "The capital of France is Paris."). Its environment is
# pathways_ray.serve.cpu_engine_env().
ENGINE_ARG_DEFAULTS = {
    "tpu": {},
    "cpu": {"enforce_eager": True, "dtype": "float32"},
}



def slice_topology(accelerator: str, topology: str | None,
                   chips_per_host: int | None = None) -> Topology:
    try:
        return Topology.parse(accelerator, topology, chips_per_host=chips_per_host)
    except ValueError as e:
        raise ValueError(f"accelerator={accelerator!r}, topology={topology!r}: {e}") from None


def accelerator_type(accelerator: str) -> str:
    """Ray's accelerator type (``TPU-V6E``) of a generation (``v6e``, ``TPU-V6E``)
    or a pod type (``v6e-16``)."""
    try:
        return generation(accelerator).accelerator_type
    except ValueError:
        return slice_topology(accelerator, None).accelerator_type


def replica_range(num_slices: int | tuple[int, int]) -> tuple[int, int]:
    """``(min, max)`` replicas (one per slice) of ``num_slices``: a number or a pair;
    a ``ValueError`` naming the argument otherwise."""
    if isinstance(num_slices, int) and not isinstance(num_slices, bool):
        lo = hi = num_slices
    elif (isinstance(num_slices, tuple) and len(num_slices) == 2
          and all(isinstance(n, int) and not isinstance(n, bool) for n in num_slices)):
        lo, hi = num_slices
    else:
        raise ValueError(
            f"num_slices={num_slices!r} must be a whole number of slices (one replica each) "
            f"or a (min, max) pair for autoscaling, e.g. num_slices=(1, 4)")
    if lo < 0 or hi < 1 or lo > hi:
        raise ValueError(
            f"num_slices={num_slices!r} needs 0 <= min <= max and max >= 1, "
            f"e.g. num_slices=2 or num_slices=(1, 4)")
    return lo, hi


def llm_config_dict(
    model_id: str,
    *,
    accelerator: str = "v6e",
    topology: str | None = "4x4",
    chips_per_host: int | None = None,
    model_source: str | None = None,
    tensor_parallel_size: int | None = None,
    enable_expert_parallel: bool = True,
    max_model_len: int = 8192,
    num_slices: int | tuple[int, int] = 1,
    initial_slices: int | None = None,
    platform: str = "tpu",
    stream_batching_interval_ms: int | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    env_vars: Mapping[str, str] | None = None,
    deployment_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``ray.serve.llm.LLMConfig`` for one slice per replica.

    The seed example, v6e 4x4 with 16-way tensor parallelism::

        llm_config_dict("Qwen/Qwen3-30B-A3B", accelerator="v6e", topology="4x4")
        # accelerator_type="TPU-V6E", accelerator_config={"kind": "tpu", "topology": "4x4"},
        # engine_kwargs={"tensor_parallel_size": 16, "enable_expert_parallel": True,
        #                "max_model_len": 8192}, autoscaling 1..1 replicas
    """
    if not isinstance(model_id, str) or not model_id.strip():
        raise ValueError(
            f"model_id={model_id!r} must name the model clients ask for, e.g. 'Qwen/Qwen3-8B'")
    if platform not in PLATFORMS:
        raise ValueError(
            f"platform={platform!r} must be 'tpu' (vLLM on TPU chips) or 'cpu' (vLLM's CPU "
            f"engine on an emulated TPU host)")
    topo = slice_topology(accelerator, topology, chips_per_host)
    if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len!r} must be a positive whole number "
                         f"of tokens, e.g. 8192")
    lo, hi = replica_range(num_slices)
    initial = max(lo, 1) if initial_slices is None else initial_slices
    if not isinstance(initial, int) or not lo <= initial <= hi:
        raise ValueError(f"initial_slices={initial_slices!r} must be within num_slices="
                         f"{num_slices!r}")
    extra = dict(engine_kwargs or {})
    for key in ("model", "served_model_name", "tensor_parallel_size"):
        if key in extra:
            raise ValueError(
                f"engine_kwargs[{key!r}] is set by llm_config itself; pass "
                + ("model_id/model_source" if key != "tensor_parallel_size"
                   else "tensor_parallel_size=") + " instead")

    if platform == "tpu":
        tp = topo.chips if tensor_parallel_size is None else tensor_parallel_size
        if tp != topo.chips:
            raise ValueError(
                f"tensor_parallel_size={tp} must equal the {topo.chips} chips of "
                f"{topo.describe()}: one replica owns a whole slice; pick a smaller "
                f"topology to use fewer chips")
    else:
        if not topo.is_single_host:
            raise ValueError(
                f"topology={topo.name!r} spans {topo.num_hosts} hosts, but on the emulated "
                f"fleet (platform='cpu') vLLM's CPU engine runs on one host; use a single-host "
                f"slice such as 2x2, or 2x4 with chips_per_host=8")
        tp = 1 if tensor_parallel_size is None else tensor_parallel_size
        if not isinstance(tp, int) or tp < 1 or tp > topo.chips:
            raise ValueError(
                f"tensor_parallel_size={tp!r} must be 1..{topo.chips} (the chips of "
                f"{topo.describe()}) on the emulated fleet")

    kwargs: dict[str, Any] = {**ENGINE_ARG_DEFAULTS[platform], "tensor_parallel_size": tp}
    if enable_expert_parallel and platform == "tpu":
        kwargs["enable_expert_parallel"] = True
    kwargs["max_model_len"] = max_model_len
    kwargs.update(extra)

    deploy = dict(deployment_config or {})
    if "num_replicas" in deploy or "autoscaling_config" in deploy:
        raise ValueError(
            "deployment_config sets replicas itself; pass num_slices=N or (min, max) instead")
    deploy["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi,
                                    "initial_replicas": initial}

    config: dict[str, Any] = {
        "model_loading_config": {"model_id": model_id,
                                 **({"model_source": model_source} if model_source else {})},
    }
    if platform == "tpu":
        config["accelerator_type"] = topo.accelerator_type
        config["accelerator_config"] = {"kind": "tpu", "topology": topo.name}
        if topo.chips_per_host != topo.generation.default_chips_per_host(topo.chips):
            # Ray Serve LLM 2.60 sizes a slice's bundles from Ray's default host size
            # (v6e 2x4: one host of 8 chips), so a 2x4 slice of two 4-chip hosts would
            # wait forever for an 8-chip host. One bundle per real host fixes that; the
            # SlicePlacementGroup still pins them all to one slice.
            config["placement_group_config"] = {
                "bundles": [{"TPU": topo.chips_per_host}] * topo.num_hosts}
    else:
        # vLLM's CPU engine with Ray Serve LLM's CPU backend; the bundle is the slice's
        # one host: every chip plus the slice-head resource only worker 0 of a slice has.
        config["accelerator_config"] = {"kind": "cpu"}
        config["placement_group_config"] = {
            "bundles": [{"CPU": 1, "TPU": topo.chips_per_host, topo.head_resource: 1}],
            "strategy": "STRICT_PACK",
        }
    config["engine_kwargs"] = kwargs
    config["deployment_config"] = deploy
    # How long Ray Serve LLM's LLMServer gathers streamed tokens before sending them on
    # (one message per batch per hop: replica -> ingress -> HTTP proxy); Ray's default
    # is 50 ms. Longer means fewer messages but a later first chunk.
    interval = stream_batching_interval_ms
    if interval is not None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"stream_batching_interval_ms={interval!r} must be a positive whole number "
                f"of milliseconds (Ray Serve LLM's default is 50)")
        config["experimental_configs"] = {"stream_batching_interval_ms": interval}
    if env_vars:
        config["runtime_env"] = {"env_vars": {str(k): str(v) for k, v in env_vars.items()}}
    return config


def openai_serve_config(*llm_configs: Mapping[str, Any], name: str = "llm",
                        route_prefix: str = "/") -> dict[str, Any]:
    """A Ray Serve config file (``serve run``/``serve deploy``, a RayService's
    ``serveConfigV2``) for Ray Serve LLM's OpenAI app over ``llm_configs``
    (dicts from :func:`llm_config_dict`)."""
    if not llm_configs:
        raise ValueError("openai_serve_config() needs at least one llm_config_dict(...)")
    return {
        "applications": [{
            "name": name,
            "route_prefix": route_prefix,
            "import_path": "ray.serve.llm:build_openai_app",
            "args": {"llm_configs": [dict(c) for c in llm_configs]},
        }]
    }
