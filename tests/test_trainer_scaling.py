"""TPU ScalingConfig checks: pure, and all before any worker starts."""

from __future__ import annotations

import pytest

from pathways_ray.trainers.scaling import plan_tpu


def plan(**kw):
    args = {"topology": "2x4", "accelerator_type": "TPU-V6E", "num_workers": 8,
            "resources_per_worker": {"TPU": 1}}
    args.update(kw)
    return plan_tpu(**args)


def test_one_worker_per_chip():
    p = plan()
    assert (p.num_slices, p.workers_per_slice, p.workers_per_host, p.chips_per_worker) == (
        1, 8, 8, 1)
    assert p.topology.pod_type == "v6e-8"
    assert "1 x v6e 2x4" in p.describe() and "8 workers" in p.describe()


def test_slices_from_num_workers():
    assert plan(num_workers=16).num_slices == 2
    assert plan(topology="4x4", num_workers=32).num_slices == 2
    p = plan(num_workers=(8, 24))  # elastic: 1 to 3 slices
    assert (p.min_slices, p.num_slices) == (1, 3)


def test_one_worker_per_host_is_the_default():
    p = plan(resources_per_worker=None, num_workers=1)
    assert (p.chips_per_worker, p.workers_per_slice) == (8, 1)
    p = plan(topology="4x4", resources_per_worker=None, num_workers=8)  # 4 hosts x 4 chips
    assert (p.chips_per_worker, p.workers_per_slice, p.num_slices) == (4, 4, 2)


def test_chips_per_host_splits_2x4_into_two_hosts():
    p = plan(chips_per_host=4, resources_per_worker={"TPU": 4}, num_workers=2)
    assert (p.topology.num_hosts, p.workers_per_slice, p.num_slices) == (2, 2, 1)
    with pytest.raises(ValueError, match=r"resources_per_worker=\{'TPU': 8\}.*4 chips per host"):
        plan(chips_per_host=4, resources_per_worker={"TPU": 8}, num_workers=1)


def test_generation_spellings():
    for acc in ("TPU-V6E", "v6e", "tpu-v6e-slice"):
        assert plan(accelerator_type=acc).topology.accelerator_type == "TPU-V6E"
    assert plan(accelerator_type="TPU-V4", topology="2x2x2", num_workers=8).num_slices == 1


@pytest.mark.parametrize("kw, field, fix", [
    ({"resources_per_worker": {"TPU": 3}}, r"resources_per_worker=\{'TPU': 3\}",
     r"1, 2, 4 or 8 chips"),
    ({"resources_per_worker": {"TPU": 0}}, r"resources_per_worker=\{'TPU': 0\}", r"\{'TPU': 1\}"),
    ({"num_workers": 6}, r"num_workers=6", r"multiple of 8 \(8, 16, 24"),
    ({"num_workers": 4}, r"num_workers=4", r"takes 8 workers"),
    ({"num_workers": (4, 16)}, r"min_workers=4", r"multiple of 8"),
    ({"topology": "3x3"}, r"topology='3x3'", r"valid shapes"),
    ({"topology": None}, r"topology=None", r"topology='2x4'"),
    ({"accelerator_type": None}, r"accelerator_type=None", r"TPU-V6E"),
    ({"accelerator_type": "TPU-V9"}, r"accelerator_type='TPU-V9'", r"v6e"),
    ({"use_gpu": True}, r"use_gpu=True", r"drop use_gpu"),
    ({"chips_per_host": 2}, r"chips_per_host=2", r"\[8, 4\]|\[4, 8\]"),
])
def test_bad_configs_name_the_field_and_the_fix(kw, field, fix):
    with pytest.raises(ValueError, match=field) as err:
        plan(**kw)
    assert err.match(fix), str(err.value)


def test_scaling_config_checks_before_ray(ray_train_scaling_config):
    with pytest.raises(ValueError, match=r"resources_per_worker=\{'TPU': 3\}.*1, 2, 4 or 8"):
        ray_train_scaling_config(use_tpu=True, topology="2x4", accelerator_type="v6e",
                                 num_workers=8, resources_per_worker={"TPU": 3})
    with pytest.raises(ValueError, match="use_gpu"):
        ray_train_scaling_config(use_tpu=True, use_gpu=True, topology="2x4",
                                 accelerator_type="TPU-V6E", num_workers=8)
    sc = ray_train_scaling_config(use_tpu=True, topology="2x4", accelerator_type="v6e",
                                  num_workers=8)
    assert sc.accelerator_type == "TPU-V6E"  # Ray's spelling, for Ray's own checks
    assert sc.resources_per_worker == {"TPU": 8, "CPU": 1}


def test_trainers_refuse_bad_configs_before_any_worker(ray_train_scaling_config):
    import ray

    from pathways_ray.trainers import JaxTrainer, TorchTrainer

    ok = ray_train_scaling_config(use_tpu=True, topology="2x4", accelerator_type="TPU-V6E",
                                  num_workers=8, resources_per_worker={"TPU": 1})
    with pytest.raises(ValueError, match=r"mode='spmd'.*single_controller"):
        JaxTrainer(lambda: None, scaling_config=ok, mode="spmd")
    with pytest.raises(ValueError, match="scaling_config=None"):
        JaxTrainer(lambda: None)
    plain = ray.train.ScalingConfig(num_workers=2)
    with pytest.raises(ValueError, match="single_controller.*use_tpu=True"):
        JaxTrainer(lambda: None, scaling_config=plain, mode="single_controller")
    # Ray's own ScalingConfig passes Ray's checks; ours still runs in the trainer.
    ray_sc = ray.train.ScalingConfig(use_tpu=True, topology="2x4", accelerator_type="TPU-V6E",
                                     num_workers=8, resources_per_worker={"TPU": 1})
    ray_sc.num_workers = 12
    with pytest.raises(ValueError, match="num_workers=12"):
        TorchTrainer(lambda: None, scaling_config=ray_sc)
    assert not ray.is_initialized()  # nothing connected, nothing started


@pytest.fixture
def ray_train_scaling_config():
    pytest.importorskip("ray.train")
    from pathways_ray.trainers import ScalingConfig

    return ScalingConfig
