"""Ray Train on TPU slices: ``JaxTrainer`` and ``TorchTrainer`` with ``use_tpu=True``.

Ray Train v2 runs underneath; its ``RunConfig``, ``CheckpointConfig``,
``FailureConfig``, ``report``, ``get_checkpoint`` and ``Result`` are Ray's own,
re-exported here. What this package adds: slices reserved and ranked
correctly, TPU configs checked before anything starts, the same scripts on an
emulated fleet (XLA CPU devices, gloo), and the single-controller mode.
``TorchTrainer`` needs the ``torch`` extra; it is imported on first use.
"""

from ray.train import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    Result,
    RunConfig,
    get_checkpoint,
    get_context,
    report,
)

from pathways_ray.trainers.config import ScalingConfig
from pathways_ray.trainers.jax import JaxTrainer, TpuJaxConfig, get_client, get_elastic
from pathways_ray.trainers.scaling import TpuPlan, plan_tpu

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "FailureConfig",
    "JaxTrainer",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TorchTrainer",
    "TpuJaxConfig",
    "TpuPlan",
    "get_checkpoint",
    "get_client",
    "get_elastic",
    "get_context",
    "plan_tpu",
    "report",
]


def __getattr__(name: str):
    if name == "TorchTrainer":  # torch is an extra: import it only when asked for
        import importlib.util

        try:
            missing = importlib.util.find_spec("torch") is None
        except ImportError:
            missing = True
        if missing:
            raise ImportError("TorchTrainer needs PyTorch, an extra of pathways-ray: "
                              "pip install 'pathways-ray[torch]'")
        from pathways_ray.trainers.torch import TorchTrainer

        return TorchTrainer
    raise AttributeError(f"module 'pathways_ray.trainers' has no attribute {name!r}")
