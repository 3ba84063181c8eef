"""The devices a proxy session shows JAX: one per chip of the session's slices. Pure.

Each chip becomes an IFRT device with the attributes JAX, pathwaysutils and MaxText
read: ``slice_index`` (which slice; pathwaysutils' elastic code groups devices by
it), ``coords`` (the chip's place in its slice's grid, from its rank, x fastest:
exact for a single-host slice; a multi-host slice's hosts own blocks of the grid,
which this does not model yet), ``core_on_chip`` and the
TPU worker (``worker_id``, the host within the slice). Device ids run over the
slices in order, chip after chip, so ``jax.devices()[4 * k: 4 * k + 4]`` is slice
``k`` of 2x2 slices. On TPU slices the platform is "tpu"; on the emulated fleet it
is the chips' own, "cpu", so the client lowers programs for what will run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEVICE_KIND", "ProxyDevice", "plan_devices"]

# ``jax.devices()[0].device_kind`` on each generation's chips (libtpu's names).
DEVICE_KIND = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite",
               "tpu7x": "TPU7x"}


@dataclass(frozen=True)
class ProxyDevice:
    """One chip, as the proxy shows it."""

    id: int
    slice_index: int
    slice_name: str
    rank: int  # within its slice (the chip worker's rank)
    worker_id: int  # the TPU host within the slice
    coords: tuple[int, ...]
    platform: str
    device_kind: str

    @property
    def memory_kind(self) -> str:
        """The memory space a program's arrays live in by default: "device" on TPU and on
        JAX's CPU devices alike (an "unpinned_host" default would make JAX lower host
        offloading into every program)."""
        return "device"

    def describe(self) -> str:
        return (f"{self.device_kind} {self.id} (slice {self.slice_index} {self.slice_name}, "
                f"host {self.worker_id}, coords {list(self.coords)})")


def _coords(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Rank -> grid coordinates, x fastest (as TPU chips are numbered)."""
    out = []
    for n in shape:
        out.append(rank % n)
        rank //= n
    while len(out) < 3:
        out.append(0)
    return tuple(out)


def plan_devices(slices: Sequence[dict]) -> list[ProxyDevice]:
    """Devices for ``slices``, each ``{"name", "topology" (a Topology), "platform",
    "workers": [(rank, worker_id, chip), ...]}`` as ``Controller.describe()`` gives
    them (plus the platform)."""
    devices = []
    for index, s in enumerate(slices):
        topo, platform = s["topology"], s["platform"]
        if platform not in ("cpu", "tpu"):
            raise ValueError(f"platform={platform!r} of slice {s['name']} must be 'cpu' or 'tpu'")
        kind = DEVICE_KIND[topo.generation.name] if platform == "tpu" else "cpu"
        for rank, worker_id, _chip in sorted(s["workers"]):
            devices.append(ProxyDevice(
                id=len(devices), slice_index=index, slice_name=s["name"], rank=rank,
                worker_id=worker_id, coords=_coords(rank, topo.shape), platform=platform,
                device_kind=kind))
    return devices
