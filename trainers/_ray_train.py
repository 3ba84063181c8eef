"""Ray Train v2 on TPU slices, with the two things its TPU path gets wrong fixed.

Ray Train v2 already reserves TPU slices with ``SlicePlacementGroup``; we keep
its controller, worker group, reporting and checkpointing, and change only:

* **Placement.** Ray pins bundles to a slice only for multi-host slices; a
  single-host slice's bundles may land on any TPU host, of any pod type, and
  several slices' bundles may mix. Here every slice is reserved through its
  ``TPU-<pod>-head`` resource and every bundle is pinned to its slice by the
  ``ray.io/tpu-slice-name`` label, whatever the slice's size.
* **Ranks.** Ray orders TPU workers by ``TPU_NAME`` only and groups local ranks
  by node IP. Within a slice that leaves rank order to bundle order, and hosts
  that share an IP (emulated hosts here, host-network pods elsewhere) merge
  into one "node". Here ranks follow (slice, TPU worker id, chip) and local
  ranks follow the Ray node.

These hook into Ray 2.60's internal ``TrainController.worker_group_cls`` and
``WorkerGroup`` methods; pyproject pins Ray to 2.60.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading

import ray
from ray.train.v2._internal.execution.callback import ReportCallback
from ray.train.v2._internal.execution.context import DistributedContext
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2._internal.execution.worker_group import WorkerGroup
from ray.train.v2._internal.execution.worker_group.placement_group_handle import (
    SlicePlacementGroupHandle,
)

from pathways_ray.trainers.scaling import TpuPlan, plan_tpu

logger = logging.getLogger(__name__)

SLICE_LABEL = "ray.io/tpu-slice-name"


def tpu_plan(scaling_config) -> TpuPlan | None:
    """The ``TpuPlan`` of a Ray Train ``ScalingConfig``, or None when it uses no TPU."""
    if not getattr(scaling_config, "use_tpu", False):
        return None
    return plan_tpu(
        topology=scaling_config.topology,
        accelerator_type=scaling_config.accelerator_type,
        num_workers=scaling_config.num_workers,
        resources_per_worker=scaling_config.resources_per_worker,
        use_gpu=scaling_config.use_gpu,
        chips_per_host=getattr(scaling_config, "chips_per_host", None),
    )


# Slices the worker group of this process (the Ray Train controller) holds right now;
# the elastic policy in the same process counts them as usable. Slices it let go of
# when its worker group was torn down count too, until the next reservation: Ray shows
# their chips busy for a moment after the release, and a restart decided in that moment
# would start on fewer slices than there are.
_held_slices: set[str] = set()
_released_slices: set[str] = set()


class _SlicesHandle(SlicePlacementGroupHandle):
    """A ``SlicePlacementGroup`` plus the slice-head reservations we made for it."""

    def __init__(self, spg, head_pgs: list, slice_names: list[str]):
        super().__init__(spg)
        self._head_pgs = head_pgs
        self._slice_names = slice_names
        _held_slices.update(slice_names)

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            super().shutdown()
        finally:
            for pg in self._head_pgs:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001 (already gone with its node)
                    logger.debug("slice head reservation already removed", exc_info=True)
            self._head_pgs = []
            _held_slices.difference_update(self._slice_names)
            _released_slices.update(self._slice_names)


def reserve_slices(plan: TpuPlan, num_slices: int, resources_per_worker: dict,
                   timeout_s: float | None) -> _SlicesHandle:
    """Reserve ``num_slices`` whole slices and one bundle per worker, pinned to its slice."""
    from ray._private.accelerators.tpu import reserve_tpu_slice
    from ray.util.placement_group import remove_placement_group
    from ray.util.tpu import SlicePlacementGroup

    topo = plan.topology
    heads, selectors = [], []
    # Free slices whose hosts answer are reserved by name: left to Ray, the head could
    # land on a slice whose host just died and that Ray still counts alive.
    free = usable_slices(plan)
    try:
        for i in range(num_slices):
            reserved = reserve_tpu_slice(topo.name, topo.accelerator_type, timeout_s=timeout_s,
                                         slice_name=free[i] if i < len(free) else None)
            if not reserved:
                raise RuntimeError(f"Ray could not infer the pod type of {topo.describe()}")
            name, head = reserved
            heads.append(head)
            selectors += [{SLICE_LABEL: name, "ray.io/tpu-pod-type": topo.pod_type}
                          ] * plan.workers_per_slice
        spg = SlicePlacementGroup(
            topology=topo.name,
            accelerator_version=topo.generation.ray_version,
            resources_per_bundle=resources_per_worker,
            num_slices=num_slices,
            chips_per_vm=topo.chips_per_host,
            strategy="PACK",
            head_reservation_timeout_s=timeout_s,
            bundle_label_selector=selectors,
        )
    except BaseException:
        for pg in heads:
            remove_placement_group(pg)
        raise
    names = sorted({s[SLICE_LABEL] for s in selectors})
    _released_slices.clear()
    logger.info("reserved %d x %s: slices %s", num_slices, topo.describe(), names)
    return _SlicesHandle(spg, heads, names)


def _chip_position() -> tuple[str, int, int]:
    """(slice name, TPU worker id, first chip) of the calling worker."""
    chips = ray.get_runtime_context().get_accelerator_ids().get("TPU") or ["0"]
    return (os.environ.get("TPU_NAME", ""), int(os.environ.get("TPU_WORKER_ID", "0") or 0),
            min(int(c) for c in chips))


def rank_tpu_workers(workers: list, starting_world_rank: int = 0,
                     world_size: int | None = None) -> list:
    """Order workers by (slice, TPU worker id, chip) and set their distributed context."""
    positions = ray.get([w.execute_async(_chip_position) for w in workers])
    order = sorted(range(len(workers)), key=lambda i: positions[i])
    ranked = [workers[i] for i in order]
    by_node: dict[str, list] = collections.defaultdict(list)
    for w in ranked:
        by_node[w.metadata.node_id].append(w)
    nodes = list(by_node)
    for rank, w in enumerate(ranked):
        peers = by_node[w.metadata.node_id]
        w.distributed_context = DistributedContext(
            world_rank=starting_world_rank + rank,
            world_size=world_size if world_size is not None else len(ranked),
            local_rank=peers.index(w),
            local_world_size=len(peers),
            node_rank=nodes.index(w.metadata.node_id),
        )
    return ranked


def usable_slices(plan: TpuPlan) -> list[str]:
    """Slices of ``plan``'s shape this run could use now: idle ones and its own, whose
    hosts all answer. A host killed a moment ago stays "alive" in Ray until its health
    checks fail; counted, it makes the restart after a slice loss ask for a slice it
    cannot have and sit out the whole worker-group start timeout (60 s)."""
    from pathways_ray.clusters.cluster import cluster_slices, hosts_answering

    views = [v for v in cluster_slices()
             if v.intact and v.topology == plan.topology
             and (v.idle or v.name in _held_slices or v.name in _released_slices)]
    answering = hosts_answering(h for v in views for h in v.hosts)
    return sorted(v.name for v in views if all(h.node_id in answering for h in v.hosts))


class TpuElasticScalingPolicy(ElasticScalingPolicy):
    """Ray's elastic policy, counting only slices that are free (or already ours).

    Ray's count of "intact" slices includes slices other jobs hold, so with one
    of two slices busy it asks for both and the start times out. Here a run with
    ``num_workers=(min, max)`` starts on the slices that are free, continues on
    N-1 when a slice is lost and grows back when one frees up (Ray Train
    restarts the worker group at the new size, from the last checkpoint).
    """

    def _get_strict_tpu_worker_count(self, total_num_workers: int) -> int:
        plan = tpu_plan(self.scaling_config)
        slices = min(total_num_workers // plan.workers_per_slice, len(usable_slices(plan)))
        return slices * plan.workers_per_slice


class TpuWorkerGroup(WorkerGroup):
    def _create_placement_group(self, scaling_config, worker_group_context):
        plan = tpu_plan(scaling_config)
        if plan is None:
            return super()._create_placement_group(scaling_config, worker_group_context)
        from ray.train.v2._internal.exceptions import (
            WorkerGroupStartupFailedError,
            WorkerGroupStartupTimeoutError,
        )

        try:
            return reserve_slices(plan, worker_group_context.num_slices,
                                  worker_group_context.resources_per_worker,
                                  self._worker_group_start_timeout_s)
        except TimeoutError as e:
            # Ray's controller retries a startup timeout (capacity may be on its way).
            raise WorkerGroupStartupTimeoutError(
                num_workers=worker_group_context.num_workers) from e
        except Exception as e:
            raise WorkerGroupStartupFailedError(f"Failed to reserve TPU slice(s): {e}") from e

    def _create_workers(self, num_workers, placement_group, resources_per_worker,
                        placement_group_bundle_indices=None, starting_world_rank=0,
                        world_size=None, replica_group_size=None):
        workers = super()._create_workers(
            num_workers, placement_group, resources_per_worker,
            placement_group_bundle_indices, starting_world_rank, world_size, replica_group_size)
        if resources_per_worker.get("TPU", 0) > 0 and replica_group_size is None:
            workers = rank_tpu_workers(workers, starting_world_rank, world_size)
        return workers


class LatestMetrics(ReportCallback):
    """Remembers rank 0's latest reported metrics, checkpoint or not."""

    def __init__(self):
        self.metrics: dict | None = None

    def after_report(self, training_report, metrics):
        self.metrics = training_report.metrics


class TpuTrainController(TrainController):
    """Ray Train's controller with ``TpuWorkerGroup``.

    ``Result.metrics`` is documented as the latest reported metrics, but Ray 2.60
    fills it from the latest *checkpoint* (None for a run that reports without
    checkpoints, stale after reports without one); here it is the latest report
    when there is one. Checkpoints keep their own metrics (``best_checkpoints``).
    """

    worker_group_cls = TpuWorkerGroup

    def __init__(self, *args, callbacks=None, **kwargs):
        self._latest = next((c for c in callbacks or [] if isinstance(c, LatestMetrics)), None)
        super().__init__(*args, callbacks=callbacks, **kwargs)

    def _build_result(self):
        result = super()._build_result()
        if self._latest is not None and self._latest.metrics is not None:
            result = dataclasses.replace(result, metrics=self._latest.metrics)
        return result


def _has_dashboard() -> bool:
    """Whether the cluster's dashboard (and with it the State API) answers.

    GCS records the dashboard's address even when ``--include-dashboard=false``
    started none, so the address is tried, not just read.
    """
    import socket

    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    address = _internal_kv_get(ray_constants.DASHBOARD_ADDRESS,
                               namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
    if not address:
        return False
    host, _, port = address.decode().rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


class TpuControllerMixin:
    """Run the trainer's Ray Train controller as ``TpuTrainController``.

    Mirrors ``DataParallelTrainer._initialize_and_run_controller`` of Ray 2.60
    with only the controller class changed.
    """

    def _create_default_callbacks(self):
        from ray.train.v2._internal.callbacks.placement_group_callback import (
            PlacementGroupCleanerCallback,
        )

        callbacks = super()._create_default_callbacks() + [LatestMetrics()]
        if _has_dashboard():
            return callbacks
        # The cleaner asks the dashboard's State API about the controller every second;
        # on a cluster without a dashboard it only logs that it cannot.
        return [c for c in callbacks if not isinstance(c, PlacementGroupCleanerCallback)]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        from ray.train.v2._internal.constants import (
            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
            get_env_vars_to_propagate,
        )

        policy = controller_init_kwargs.get("scaling_policy")
        if type(policy) is ElasticScalingPolicy and tpu_plan(policy.scaling_config):
            controller_init_kwargs["scaling_policy"] = TpuElasticScalingPolicy(
                policy.scaling_config)
        env_vars = get_env_vars_to_propagate()
        env_vars.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
        controller_cls = ray.remote(
            num_cpus=0,
            label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
            runtime_env={"env_vars": env_vars},
        )(TpuTrainController)
        controller = controller_cls.remote(**controller_init_kwargs)
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())
