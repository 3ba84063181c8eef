"""``TorchTrainer`` with ``ScalingConfig(use_tpu=True, ...)``: one worker per chip.

Device and process-group backend are chosen per run, on the workers, and logged:

=====================  ==============  ===========  =========================
found on the workers   device          backend      note
=====================  ==============  ===========  =========================
``torch_tpu``          ``tpu``         tpu_dist     the TorchTPU runtime
``torch_xla``          ``xla:0``       xla          PyTorch/XLA, PJRT_DEVICE=TPU
neither, or emulated   ``cpu``         gloo         the emulated fleet
=====================  ==============  ===========  =========================

The same script runs everywhere: it asks ``get_device()`` for its device and
never branches on hardware. Ray's ``ray.train.torch.get_device()`` raises on a
TPU worker without ``torch_tpu``, so use this one. Several slices form one
process group (gradients are reduced across slices); with ``torch_tpu`` the
``MEGASCALE_*`` variables are set per slice as Ray does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import ray
from ray.train.torch.config import TorchConfig, _TorchBackend
from ray.train.v2.torch.torch_trainer import TorchTrainer as _RayTorchTrainer

from pathways_ray.trainers._ray_train import TpuControllerMixin, tpu_plan

__all__ = ["TorchTrainer", "TpuTorchConfig", "get_device", "runtime", "slice_mesh"]

logger = logging.getLogger(__name__)

# runtime -> (device type, process group backend)
_RUNTIMES = {"torch_tpu": ("tpu", "tpu_dist"), "torch_xla": ("xla", "xla"),
             "cpu": ("cpu", "gloo")}


def runtime() -> str:
    """Which PyTorch runtime drives this process's chip: ``torch_tpu``, ``torch_xla`` or
    ``cpu`` (no TPU on this host — the emulated fleet — or neither package)."""
    from pathways_ray.chips.chip_worker import detect_platform

    if detect_platform() == "tpu":
        for module in ("torch_tpu", "torch_xla"):
            try:
                __import__(module)
                return module
            except ImportError:
                continue
    return "cpu"


def get_device():
    """The ``torch.device`` of this worker's chip (see the module's table)."""
    import torch

    kind = runtime()
    if kind == "torch_tpu":
        return torch.device("tpu")
    if kind == "torch_xla":
        import torch_xla

        return torch_xla.device()
    return torch.device("cpu")


def slice_mesh(mesh_dim_names: tuple[str, str] = ("slices", "chips")):
    """A 2-D ``DeviceMesh`` of the run's workers: one row per slice, the chips of a slice
    along the second dimension (e.g. ``("dp", "tp")``: data parallel across slices,
    tensor parallel over the chips of a slice, whose links are the fast ones).

    Call it on every worker once the process group exists (inside the train loop).
    Rows follow each worker's ``TPU_NAME``, so the mesh is right however the ranks
    were numbered; slices of different sizes raise ``ValueError`` naming them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, os.environ.get("TPU_NAME", ""))
    rows: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        rows.setdefault(name, []).append(rank)
    sizes = {name: len(ranks) for name, ranks in rows.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"slice_mesh needs slices of one size; workers per slice: {sizes}")
    return DeviceMesh(get_device().type, torch.tensor(list(rows.values())),
                      mesh_dim_names=tuple(mesh_dim_names))


@dataclass
class TpuTorchConfig(TorchConfig):
    """``TorchConfig`` whose ``backend="auto"`` picks tpu_dist, xla or gloo on the workers."""

    backend: str | None = "auto"

    @property
    def backend_cls(self):
        return _TpuTorchBackend


def _set_env(master_addr: str, master_port: int, kind: str) -> None:
    ctx = ray.train.get_context()
    os.environ.update({
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "RANK": str(ctx.get_world_rank()), "WORLD_SIZE": str(ctx.get_world_size()),
        "LOCAL_RANK": str(ctx.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
        "NODE_RANK": str(ctx.get_node_rank()),
    })
    if kind == "torch_xla":
        os.environ.setdefault("PJRT_DEVICE", "TPU")


def _init_process_group(backend: str, rank: int, world_size: int, timeout_s: int) -> None:
    import torch.distributed as dist

    init_method = "env://"
    if backend == "tpu_dist":
        from ray.air._internal.device_manager import register_custom_torch_dist_backend

        register_custom_torch_dist_backend(backend)
    elif backend == "xla":
        import torch_xla.distributed.xla_backend  # noqa: F401 (registers "xla")

        init_method = "xla://"
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class _TpuTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: TpuTorchConfig):
        if backend_config.backend != "auto":
            return super().on_start(worker_group, backend_config)
        from ray.train._internal.utils import get_address_and_port

        kinds = set(worker_group.execute(runtime))
        if len(kinds) != 1:
            raise RuntimeError(f"workers found different PyTorch runtimes {sorted(kinds)}; "
                               f"install the same torch_tpu / torch_xla on every TPU host")
        kind = kinds.pop()
        device, backend = _RUNTIMES[kind]
        n = len(worker_group)
        logger.info("TorchTrainer: %d workers, device %r, process group backend %r (%s)", n,
                    device, backend, {"torch_tpu": "TorchTPU runtime found",
                                      "torch_xla": "PyTorch/XLA found",
                                      "cpu": "no TPU runtime: emulated chips on CPU"}[kind])
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_env, addr, port, kind)
        num_slices = worker_group.get_worker_group_context().num_slices
        if kind == "torch_tpu" and num_slices > 1:
            self._setup_tpu_multislice(worker_group, addr, num_slices)
        ray.get([worker_group.execute_single_async(i, _init_process_group, backend, i, n,
                                                   backend_config.timeout_s)
                 for i in range(n)])

    def on_shutdown(self, worker_group, backend_config):
        if backend_config.backend != "auto":
            return super().on_shutdown(worker_group, backend_config)
        try:
            ray.get(worker_group.execute_async(_destroy_process_group), timeout=60)
        except ray.exceptions.GetTimeoutError:
            logger.warning("torch process group shutdown timed out after 60 s")


class TorchTrainer(TpuControllerMixin, _RayTorchTrainer):
    """``ray.train.v2.torch.TorchTrainer`` that also runs on TPU slices and emulated ones.

    Same arguments as Ray's. With ``use_tpu=True`` the TPU fields are checked
    before anything starts and ``torch_config`` defaults to ``TpuTorchConfig()``.
    """

    def __init__(self, train_loop_per_worker, *, train_loop_config=None, torch_config=None,
                 scaling_config=None, run_config=None, datasets=None, dataset_config=None,
                 **kwargs):
        if tpu_plan(scaling_config) is not None and torch_config is None:
            torch_config = TpuTorchConfig()
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         torch_config=torch_config, scaling_config=scaling_config,
                         run_config=run_config, datasets=datasets,
                         dataset_config=dataset_config, **kwargs)
