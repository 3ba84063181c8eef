"""Carrying a chip's buffers from one JAX world into the next.

A world of several slices cannot take a slice back in place (``world_service.py``:
the survivors keep the gloo cliques they had with the lost slice's processes), so the
controller re-forms it: every chip of the live slices gets a new process in a new
world (``controller.reform``). Before the old processes go, each chip hands over its
buffers (``export_buffers``: its own shard of each, with the array's shape, dtype and
sharding), as the return value of a Ray call, so the bytes wait in the host's object
store, owned by the controller, not by the process that goes; the new process on the
same chip builds the same arrays from them (``import_buffers``), the sharding's
devices renamed from the old world's ids to the new ones. A buffer that had failed is
carried as its failure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Carried", "CarriedBuffers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Carried:
    """One buffer as one chip holds it: its global shape and dtype, its sharding (its
    devices' world ids, and the mesh's axis names and sizes and the spec for a
    ``NamedSharding``, or the XLA ``OpSharding`` bytes for any other), and this chip's
    shard; or, for a failed buffer, its failure."""

    shape: tuple[int, ...]
    dtype: str
    devices: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    axis_sizes: tuple[int, ...] = ()
    spec: tuple = ()
    op_sharding: bytes | None = None
    shard: np.ndarray | None = None
    failed: Any = None


def _carry(value) -> Carried:
    from jax.sharding import NamedSharding

    sharding = value.sharding
    common = dict(shape=tuple(value.shape), dtype=np.dtype(value.dtype).name,
                  shard=np.asarray(value.addressable_data(0)))
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return Carried(devices=tuple(int(d.id) for d in mesh.devices.flat),
                       axis_names=tuple(mesh.axis_names),
                       axis_sizes=tuple(int(n) for n in mesh.devices.shape),
                       spec=tuple(sharding.spec), **common)
    hlo = sharding._to_xla_hlo_sharding(value.ndim)
    return Carried(devices=tuple(int(d.id) for d in sharding._device_assignment),
                   op_sharding=hlo.to_proto().SerializeToString(), **common)


class CarriedBuffers:
    """Mixin of ``ChipWorker``: hand a chip's buffers over to the next world."""

    def export_buffers(self, after: int = 0, lease: str | None = None) -> dict[int, Carried]:
        """Every buffer of this chip, once the first ``after`` batches of its stream
        have run."""
        from pathways_ray.chips.executor import Failed

        self._check_lease(lease)
        self._after(after)
        out: dict[int, Carried] = {}
        for buffer_id, value in list(self.executor.buffers.items()):
            out[buffer_id] = (Carried((), "", (), failed=value) if isinstance(value, Failed)
                              else _carry(value))
        logger.info("chip rank %s: %d buffers handed over", self.rank, len(out))
        return out

    def import_buffers(self, carried: dict[int, Carried], renamed: dict[int, int],
                       lost: str = "", lease: str | None = None) -> int:
        """Rebuild the buffers another process of this chip handed over (``renamed``:
        old world device id -> this world's). A buffer that also lived on devices no
        longer in the world (a lost slice's, named by ``lost``) comes back failed with
        ``SliceLost``. Returns how many."""
        import jax
        from jax._src.lib import xla_client
        from jax._src.sharding_impls import GSPMDSharding
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from pathways_ray.chips.executor import Failed
        from pathways_ray.errors import SliceLost

        self._check_lease(lease)
        world = {d.id: d for d in jax.devices()}
        local = jax.local_devices()[0]
        shardings: dict[tuple, Any] = {}
        for buffer_id, c in carried.items():
            if c.failed is not None:
                self.executor.buffers[buffer_id] = c.failed
                continue
            if any(d not in renamed for d in c.devices):
                self.executor.buffers[buffer_id] = Failed(
                    "carry", "", SliceLost(lost or "?", reason="the array also lived on "
                                           "a slice that was lost"))
                continue
            key = (c.devices, c.axis_names, c.axis_sizes, c.spec, c.op_sharding)
            sharding = shardings.get(key)
            if sharding is None:
                devices = [world[renamed[d]] for d in c.devices]
                if c.op_sharding is None:
                    mesh = Mesh(np.array(devices).reshape(c.axis_sizes), c.axis_names)
                    sharding = NamedSharding(mesh, PartitionSpec(*c.spec))
                else:
                    proto = xla_client.OpSharding()
                    proto.ParseFromString(c.op_sharding)
                    sharding = GSPMDSharding(devices, proto)
                shardings[key] = sharding
            self.executor.buffers[buffer_id] = jax.make_array_from_single_device_arrays(
                c.shape, sharding, [jax.device_put(c.shard, local)])
        return len(carried)
