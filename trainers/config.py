"""Ray Train's ``ScalingConfig``, checked for TPUs the way this project lays them out."""

from __future__ import annotations

from dataclasses import dataclass

from ray.train import ScalingConfig as _RayScalingConfig

from pathways_ray.trainers.scaling import plan_tpu

__all__ = ["ScalingConfig"]


@dataclass
class ScalingConfig(_RayScalingConfig):
    """``ray.train.ScalingConfig`` plus ``chips_per_host``.

    With ``use_tpu=True`` the TPU fields are checked before Ray's own checks,
    so a bad config fails with one message naming the field, the value and
    what fits. ``chips_per_host`` picks the host size where GKE offers two
    (v5e/v6e ``2x4``: one 8-chip host, or ``chips_per_host=4`` for two).
    Ray Train's trainers take this class wherever they take Ray's.
    """

    chips_per_host: int | None = None

    def __post_init__(self):
        if self.use_tpu:
            plan = plan_tpu(topology=self.topology, accelerator_type=self.accelerator_type,
                            num_workers=self.num_workers,
                            resources_per_worker=self.resources_per_worker,
                            use_gpu=self.use_gpu, chips_per_host=self.chips_per_host)
            # Ray's spelling of the generation ("TPU-V6E"), whatever the user wrote.
            self.accelerator_type = plan.topology.accelerator_type
            if self.resources_per_worker is None:
                self.resources_per_worker = {"TPU": plan.chips_per_worker, "CPU": 1}
        super().__post_init__()
