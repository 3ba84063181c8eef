"""``JaxTrainer``: Ray Train's JAX trainer on TPU slices, in two modes.

``mode="multi_controller"`` (default) is the Ray Train a Ray user knows: the
train loop runs on every worker, one JAX process per worker, joined by
``jax.distributed`` across all slices. On TPU hosts JAX runs on the chips
(multi-slice via the ``MEGASCALE_*`` variables); on an emulated fleet each
worker gets one XLA CPU device per chip it holds and collectives run over gloo.

``mode="single_controller"`` runs the train loop once, in one Ray Train worker
that holds a ``pathways_ray`` client: the controller reserves the slices and
the loop dispatches compiled steps to them (``get_client()`` inside the loop).
``ray.train.report`` and checkpoints work as usual. This is the mode that can
continue on N-1 slices: with ``num_workers=(min, max)`` the loop's client takes
the slices that are free (at least ``min`` workers' worth, waiting if need
be), and ``get_elastic()`` gives ``DataParallelTrainer`` the matching
``min_slices`` and ``grow=True``. A lost slice then costs the loop at most one
step, with no Ray Train restart; below ``min`` it raises, and Ray Train's
``FailureConfig`` restarts the loop on a fresh reservation.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass

import ray
from ray.train.backend import Backend
from ray.train.v2.jax import JaxTrainer as _RayJaxTrainer
from ray.train.v2.jax.config import JaxConfig

from pathways_ray.chips.chip_worker import detect_platform
from pathways_ray.trainers._ray_train import TpuControllerMixin, tpu_plan

__all__ = ["JaxTrainer", "TpuJaxConfig", "get_client", "get_elastic"]

logger = logging.getLogger(__name__)

MODES = ("multi_controller", "single_controller")
_client = None  # the single-controller loop's client, in the worker that runs the loop
_elastic: dict | None = None  # and its DataParallelTrainer settings


def get_client():
    """The ``pathways_ray`` client of a ``JaxTrainer(mode="single_controller")`` loop."""
    if _client is None:
        raise RuntimeError("get_client() works inside the train loop of "
                           "JaxTrainer(..., mode='single_controller') only")
    return _client


def get_elastic() -> dict:
    """``DataParallelTrainer`` keyword arguments that make a ``mode="single_controller"``
    loop as elastic as its ``ScalingConfig``: ``min_slices`` from
    ``num_workers=(min, max)`` (a fixed ``num_workers`` keeps every slice it started
    with), and ``grow=True`` to take back lost slices as capacity returns."""
    if _elastic is None:
        raise RuntimeError("get_elastic() works inside the train loop of "
                           "JaxTrainer(..., mode='single_controller') only")
    return dict(_elastic)


@dataclass
class TpuJaxConfig(JaxConfig):
    """``JaxConfig`` whose TPU setup also runs on emulated TPU hosts.

    ``init_timeout_s`` bounds joining the JAX world.
    """

    init_timeout_s: float = 300.0

    @property
    def backend_cls(self):
        return _TpuJaxBackend


def _init_jax(coordinator: str, num_processes: int, process_id: int, platform: str,
              chips: int, extra_env: dict[str, str], timeout_s: float) -> dict:
    """Join the JAX world on this worker (before the train loop imports JAX)."""
    from pathways_ray.chips.worker_env import cpu_env

    env = cpu_env(os.environ, devices=chips) if platform == "cpu" else {"JAX_PLATFORMS": "tpu"}
    if platform == "tpu" and "JAX_PLATFORMS" in os.environ:
        env.pop("JAX_PLATFORMS")  # the user's choice wins on real hosts
    env.update(extra_env)
    for key, value in env.items():
        if value == "":
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    import jax

    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id,
                               initialization_timeout=int(max(1, timeout_s)))
    return {"platform": platform, "devices": jax.device_count(),
            "local_devices": jax.local_device_count()}


def _reserve_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"


class _TpuJaxBackend(Backend):
    def on_start(self, worker_group, backend_config: TpuJaxConfig):
        scaling = worker_group._train_run_context.scaling_config
        plan = tpu_plan(scaling)
        if plan is None:
            from ray.train.v2.jax.config import _JaxBackend

            return _JaxBackend().on_start(worker_group, backend_config)
        from ray.train._internal.utils import get_address_and_port
        from ray.util.tpu import get_tpu_coordinator_env_vars

        from pathways_ray.chips.worker_env import tpu_multiprocess_env

        n = len(worker_group)
        num_slices = worker_group.get_worker_group_context().num_slices
        per_slice = n // num_slices
        platforms = set(worker_group.execute(detect_platform))
        if len(platforms) != 1:
            raise RuntimeError(f"workers disagree on their platform: {sorted(platforms)}; a "
                               f"run cannot mix TPU hosts and emulated ones")
        platform = platforms.pop()
        addr, port = worker_group.execute_single(0, get_address_and_port)
        envs: list[dict[str, str]] = [{} for _ in range(n)]
        if platform == "tpu":
            if plan.chips_per_worker == 1 and plan.topology.chips_per_host > 1:
                # One process per chip: libtpu needs the slice's process grid.
                addresses = worker_group.execute(_reserve_port)
                workers = worker_group.get_workers()
                for i in range(n):
                    s, r = divmod(i, per_slice)
                    chip = int(workers[i].metadata.accelerator_ids["TPU"][0])
                    envs[i] = tpu_multiprocess_env(
                        rank=r, chip=chip, process_addresses=addresses[s * per_slice:
                                                                       (s + 1) * per_slice],
                        slice_shape=plan.topology.shape)
            elif plan.chips_per_worker != plan.topology.chips_per_host:
                raise ValueError(
                    f"resources_per_worker={{'TPU': {plan.chips_per_worker}}} on real TPUs: "
                    f"JaxTrainer runs one process per chip ({{'TPU': 1}}) or per host "
                    f"({{'TPU': {plan.topology.chips_per_host}}})")
            if num_slices > 1:
                for i in range(n):
                    envs[i].update(get_tpu_coordinator_env_vars(
                        coordinator_address=addr, num_slices=num_slices,
                        slice_id=i // per_slice))
        infos = ray.get([
            worker_group.execute_single_async(
                i, _init_jax, coordinator=f"{addr}:{port}", num_processes=n, process_id=i,
                platform=platform, chips=plan.chips_per_worker, extra_env=envs[i],
                timeout_s=backend_config.init_timeout_s)
            for i in range(n)])
        logger.info("JAX world: %d processes on %s (%s), %d devices", n, plan.describe(),
                    "emulated on CPU" if platform == "cpu" else "TPU", infos[0]["devices"])

    def on_shutdown(self, worker_group, backend_config):
        from ray.train.v2.jax.config import _JaxBackend

        _JaxBackend().on_shutdown(worker_group, backend_config)


class _SingleControllerLoop:
    """The train function of ``mode="single_controller"`` (runs in one Ray Train worker).

    A class, not a closure: it pickles by reference, so the client it sets is the
    one ``get_client()`` of this module reads.
    """

    def __init__(self, user_fn, plan, reserve_timeout_s: float):
        self.user_fn = user_fn
        self.plan = plan
        self.reserve_timeout_s = reserve_timeout_s
        self.__name__ = getattr(user_fn, "__name__", "train_loop")

    def __call__(self, config: dict):
        global _client, _elastic
        from pathways_ray.client.connect import connect

        plan, count = self.plan, self.plan.num_slices
        if plan.min_slices < plan.num_slices:  # elastic: the free slices, at least min
            from pathways_ray.trainers._ray_train import usable_slices

            count = max(plan.min_slices, min(count, len(usable_slices(plan))))
        _client = connect([plan.topology] * count, reserve_timeout_s=self.reserve_timeout_s)
        _elastic = {"min_slices": plan.min_slices, "grow": True}
        logger.info("single controller on %d of %d-%d x %s", count, plan.min_slices,
                    plan.num_slices, plan.topology.describe())
        try:
            if len(inspect.signature(self.user_fn).parameters) > 0:
                return self.user_fn(config)
            return self.user_fn()
        finally:
            client, _client, _elastic = _client, None, None
            client.close()


class JaxTrainer(TpuControllerMixin, _RayJaxTrainer):
    """``ray.train.v2.jax.JaxTrainer`` that runs on TPU slices and on emulated ones.

    Same arguments as Ray's, plus ``mode`` (``"multi_controller"`` or
    ``"single_controller"``) and ``reserve_timeout_s`` (single controller: how
    long to wait for the slices).
    """

    def __init__(self, train_loop_per_worker, *, train_loop_config=None, jax_config=None,
                 scaling_config=None, run_config=None, datasets=None, dataset_config=None,
                 mode: str = "multi_controller", reserve_timeout_s: float = 300.0, **kwargs):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not a JaxTrainer mode; use one of {list(MODES)}")
        if scaling_config is None:
            raise ValueError("scaling_config=None: JaxTrainer needs a ScalingConfig, e.g. "
                             "ScalingConfig(use_tpu=True, topology='2x4', "
                             "accelerator_type='TPU-V6E', num_workers=8, "
                             "resources_per_worker={'TPU': 1})")
        plan = tpu_plan(scaling_config)  # checked here, before any worker starts
        self.mode = mode
        self.tpu_plan = plan
        if mode == "single_controller":
            if plan is None:
                raise ValueError("mode='single_controller' drives TPU slices; set "
                                 "ScalingConfig(use_tpu=True, topology=..., accelerator_type=...)")
            if datasets:
                raise ValueError("datasets= is not supported with mode='single_controller'; "
                                 "feed batches from the loop (client.device_put)")
            train_loop_per_worker = _SingleControllerLoop(train_loop_per_worker, plan,
                                                         reserve_timeout_s)
            train_loop_config = train_loop_config or {}
            # One Ray Train worker runs the loop; it holds no chip (the slices' chip
            # workers do), so it is free to land anywhere.
            from ray.train import ScalingConfig as RayScalingConfig

            scaling_config = RayScalingConfig(num_workers=1, resources_per_worker={"CPU": 1})
            jax_config = jax_config or JaxConfig()
        elif plan is not None:
            jax_config = jax_config or TpuJaxConfig(use_tpu=True)
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         jax_config=jax_config, scaling_config=scaling_config,
                         run_config=run_config, datasets=datasets,
                         dataset_config=dataset_config, **kwargs)
