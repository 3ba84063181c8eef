"""A TPU slice -> Ray Serve LLM config: pure planning, then Ray Serve LLM's own
validation and placement of what we build (no cluster, no engine)."""

from __future__ import annotations

import pytest

from pathways_ray.serve import llm_config_dict


def test_v6e_4x4_is_the_seed_example():
    cfg = llm_config_dict("Qwen/Qwen3-30B-A3B", accelerator="v6e", topology="4x4")
    assert cfg["accelerator_type"] == "TPU-V6E"
    assert cfg["accelerator_config"] == {"kind": "tpu", "topology": "4x4"}
    assert cfg["engine_kwargs"] == {"tensor_parallel_size": 16, "enable_expert_parallel": True,
                                    "max_model_len": 8192}
    assert cfg["model_loading_config"] == {"model_id": "Qwen/Qwen3-30B-A3B"}
    assert cfg["deployment_config"]["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 1, "initial_replicas": 1}
    assert "placement_group_config" not in cfg  # Ray Serve LLM reserves the slice itself
    assert "experimental_configs" not in cfg  # Ray's 50 ms stream batching


@pytest.mark.parametrize("accelerator,topology,chips_per_host,chips,accel_type", [
    ("v6e", "2x2", None, 4, "TPU-V6E"),
    ("v6e", "2x4", None, 8, "TPU-V6E"),
    ("v6e", "8x8", None, 64, "TPU-V6E"),
    ("v5e", "4x4", None, 16, "TPU-V5LITEPOD"),
    ("v5p", "2x2x2", None, 8, "TPU-V5P"),
    ("v4", "2x2x4", None, 16, "TPU-V4"),
    ("v6e-16", None, None, 16, "TPU-V6E"),
])
def test_other_generations_and_shapes(accelerator, topology, chips_per_host, chips,
                                      accel_type):
    cfg = llm_config_dict("m", accelerator=accelerator, topology=topology,
                          chips_per_host=chips_per_host)
    assert cfg["engine_kwargs"]["tensor_parallel_size"] == chips
    assert cfg["accelerator_type"] == accel_type


def test_autoscaling_one_replica_per_slice():
    cfg = llm_config_dict("m", topology="2x4", num_slices=(1, 4))
    assert cfg["deployment_config"]["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 1}
    assert llm_config_dict("m", topology="2x4", num_slices=(0, 2))["deployment_config"][
        "autoscaling_config"]["initial_replicas"] == 1


def test_emulated_replica_holds_its_slice_host():
    cfg = llm_config_dict("smollm2", topology="2x2", platform="cpu", max_model_len=2048,
                          model_source="/ckpt", env_vars={"A": 1})
    assert cfg["accelerator_config"] == {"kind": "cpu"}
    assert "accelerator_type" not in cfg
    assert cfg["placement_group_config"] == {
        "bundles": [{"CPU": 1, "TPU": 4, "TPU-v6e-4-head": 1}], "strategy": "STRICT_PACK"}
    assert cfg["engine_kwargs"] == {"enforce_eager": True, "dtype": "float32",
                                    "tensor_parallel_size": 1, "max_model_len": 2048}
    assert cfg["model_loading_config"] == {"model_id": "smollm2", "model_source": "/ckpt"}
    assert cfg["runtime_env"] == {"env_vars": {"A": "1"}}
    assert "experimental_configs" not in cfg
    assert llm_config_dict("m", topology="2x2", stream_batching_interval_ms=200)[
        "experimental_configs"] == {"stream_batching_interval_ms": 200}


@pytest.mark.parametrize("kwargs,field", [
    ({"model_id": ""}, "model_id"),
    ({"accelerator": "v9"}, "accelerator='v9'"),
    ({"topology": "3x3"}, "topology='3x3'"),
    ({"topology": "2x2x2"}, "topology='2x2x2'"),          # v6e is 2D
    ({"tensor_parallel_size": 8}, "tensor_parallel_size=8"),  # 4x4 has 16 chips
    ({"max_model_len": 0}, "max_model_len=0"),
    ({"num_slices": 0}, "num_slices=0"),
    ({"num_slices": (3, 2)}, "num_slices=(3, 2)"),
    ({"num_slices": "2"}, "num_slices='2'"),
    ({"platform": "gpu"}, "platform='gpu'"),
    ({"stream_batching_interval_ms": 0}, "stream_batching_interval_ms=0"),
    ({"engine_kwargs": {"tensor_parallel_size": 2}}, "engine_kwargs['tensor_parallel_size']"),
    ({"engine_kwargs": {"model": "x"}}, "engine_kwargs['model']"),
    ({"deployment_config": {"num_replicas": 2}}, "num_slices"),
    ({"platform": "cpu", "topology": "4x4"}, "topology='4x4'"),  # 4 hosts: not on vLLM CPU
    ({"platform": "cpu", "topology": "2x2", "tensor_parallel_size": 8},
     "tensor_parallel_size=8"),
])
def test_bad_combinations_name_the_field(kwargs, field):
    kwargs = {"model_id": "m", **kwargs}
    with pytest.raises(ValueError) as e:
        llm_config_dict(kwargs.pop("model_id"), **kwargs)
    assert field in str(e.value)


# ---- what Ray Serve LLM itself makes of these configs ----------------------------
serve_llm = pytest.importorskip("ray.serve.llm", reason="needs vLLM (./run.sh test installs it)")


def _engine(cfg: dict):
    return serve_llm.LLMConfig(**cfg).get_engine_config()


def test_ray_serve_llm_reserves_the_4x4_slice_as_4_hosts_of_4_chips():
    engine = _engine(llm_config_dict("Qwen/Qwen3-30B-A3B", topology="4x4"))
    # 16-way tensor parallelism over 4 hosts x 4 chips, deferred to a SlicePlacementGroup
    assert engine.tensor_parallel_degree == 16
    assert engine.placement_bundles == [{"TPU": 4, "accelerator_type:TPU-V6E": 0.001}] * 4
    assert engine.accelerator.requires_deferred_placement_group
    assert engine.get_initialization_kwargs()["distributed_executor_backend"] == "ray"
    assert engine.get_initialization_kwargs()["enable_expert_parallel"] is True


def test_hosts_smaller_than_rays_default_get_one_bundle_each():
    """v6e 2x4 on 4-chip hosts (ct6e-standard-4t): Ray Serve LLM alone asks for one
    8-chip host, which no such slice has."""
    cfg = llm_config_dict("m", topology="2x4", chips_per_host=4)
    assert cfg["placement_group_config"] == {"bundles": [{"TPU": 4}, {"TPU": 4}]}
    assert "placement_group_config" not in llm_config_dict("m", topology="2x4")
    engine = _engine(cfg)
    assert [b["TPU"] for b in engine.placement_bundles] == [4, 4]
    assert engine.accelerator.requires_deferred_placement_group


def test_ray_serve_llm_takes_the_emulated_config():
    engine = _engine(llm_config_dict("smollm2", topology="2x2", platform="cpu",
                                     model_source="/ckpt"))
    assert not engine.accelerator.requires_deferred_placement_group
    assert engine.placement_bundles == [{"CPU": 1, "TPU": 4, "TPU-v6e-4-head": 1}]
    kwargs = engine.get_initialization_kwargs()
    assert kwargs["distributed_executor_backend"] == "mp"  # vLLM has no Ray executor on CPU
    assert kwargs["model"] == "/ckpt" and kwargs["served_model_name"] == ["smollm2"]


def test_example_serve_config_yaml_is_the_generated_v6e_4x4_app():
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from pathways_ray.serve import openai_serve_config

    path = Path(__file__).parent.parent / "examples" / "serve_config.yaml"
    text = yaml.safe_load(path.read_text())
    want = openai_serve_config(llm_config_dict("Qwen/Qwen3-30B-A3B", accelerator="v6e",
                                               topology="4x4"))
    assert text["applications"] == want["applications"]
    ServeDeploySchema.model_validate(text)  # what `serve run` / `serve deploy` check
    (llm,) = text["applications"][0]["args"]["llm_configs"]
    assert _engine(llm).tensor_parallel_degree == 16


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--topology", "3x3"], "topology='3x3'"),
    (["serve", "--slices", "x"], "--slices"),
    (["serve", "--platform", "gpu"], "--platform"),
    (["serve", "--name", "My_App"], "becomes the app's URL path"),
    (["serve", "stop"], "invalid choice: 'stop'"),
    (["serve", "delete"], "name the app"),
    (["serve", "--model", "smollm2", "--model", "smollm2"], "each model once"),
])
def test_serve_cli_rejects_bad_flags_before_starting_anything(argv, needle, capsys):
    from pathways_ray.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_llm_config_gives_a_tpu_replica_the_persistent_compilation_cache(monkeypatch):
    from pathways_ray.serve import llm_config

    monkeypatch.setenv("PATHWAYS_RAY_COMPILATION_CACHE_DIR", "gs://bucket/xla-cache/")
    cfg = llm_config("Qwen/Qwen3-30B-A3B", topology="4x4")
    assert cfg.runtime_env == {"env_vars": {"VLLM_XLA_CACHE_PATH": "gs://bucket/xla-cache/vllm"}}
    assert cfg.accelerator_type == "TPU-V6E"
    assert cfg.engine_kwargs["tensor_parallel_size"] == 16


@pytest.mark.parametrize("accelerator", ["v6e", "TPU-V6E", "v6e-16", "tpu-v6e-slice"])
def test_accelerator_type_from_a_generation_or_pod_type(accelerator):
    from pathways_ray.serve.plan import accelerator_type

    assert accelerator_type(accelerator) == "TPU-V6E"


@pytest.mark.parametrize("source, skip", [
    ("local", True),                       # a directory here: nothing to download
    ("gs://bucket/models/qwen", False),    # remote: Ray downloads it on every node
    ("Qwen/Qwen3-30B-A3B", False),         # a Hugging Face id: Ray's path as before
])
def test_node_init_is_skipped_only_for_a_local_model_directory(tmp_path, source, skip):
    """Ray Serve LLM's per-node download tasks run unless the model is a directory
    here with no mirror (then they would only start processes); our callback, as
    Ray Serve LLM loads it from the config, decides that from the engine config."""
    import asyncio

    from pathways_ray.serve import llm_config

    if source == "local":
        source = str(tmp_path)
    cfg = llm_config("m", model_source=source, topology="4x4")
    from ray.llm._internal.common.utils.import_utils import load_class

    cls = load_class(cfg.callback_config.callback_class)  # as Ray Serve LLM does
    callback = cls(llm_config=cfg)
    assert callback.ctx.run_init_node
    asyncio.run(callback.run_callback("on_before_node_init"))
    assert callback.ctx.run_init_node is not skip


def test_the_emulated_engine_computes_on_its_share_of_the_cores():
    """Ray would give the replica's engine OMP_NUM_THREADS=1, which vLLM keeps."""
    import os

    from pathways_ray.serve import cpu_engine_env, llm_config

    cores = len(os.sched_getaffinity(0))
    assert cpu_engine_env()["OMP_NUM_THREADS"] == str(cores)
    assert cpu_engine_env(2)["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert cpu_engine_env(4 * cores)["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ValueError, match="replicas=0 must be a positive int"):
        cpu_engine_env(0)
    for slices, share in ((1, cores), (2, cores // 2), ((1, 2), cores // 2)):
        cfg = llm_config("m", topology="2x2", platform="cpu", model_source="/ckpt",
                         num_slices=slices)
        assert cfg.runtime_env["env_vars"]["OMP_NUM_THREADS"] == str(max(1, share))
