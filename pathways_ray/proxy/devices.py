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

Every device has a ``colocation_id`` (``jax.experimental.colocated_python`` pairs
devices with the CPU devices of their host by it). On the emulated fleet each chip
is a CPU device and its own; on TPU slices each chip gets a CPU device beside it
(ids after the chips', not in ``jax.devices()``), whose arrays that chip holds (in its
default memory for now, not yet its host's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pathways_ray.client.arrays import MEMORY_KINDS
from pathways_ray.proxy.protos import xla_python_ifrt_attribute_map_pb2 as attribute_map_pb2
from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2

__all__ = ["DEVICE_KIND", "ProxyDevice", "init_response", "plan_devices"]

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
    colocated: int | None = None  # a TPU chip's CPU device: the chip's id

    @property
    def colocation_id(self) -> int:
        return self.id if self.colocated is None else self.colocated

    def describe(self) -> str:
        if self.colocated is not None:
            return (f"cpu {self.id} (host of TPU device {self.colocated}: slice "
                    f"{self.slice_index} {self.slice_name}, host {self.worker_id})")
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
    chips = [d for d in devices if d.platform == "tpu"]
    for d in chips:  # each TPU chip's colocated CPU device (colocated_cpu_devices)
        devices.append(replace(d, id=len(devices), platform="cpu", device_kind="cpu",
                               colocated=d.id))
    return devices


# ---- the InitResponse: the devices as JAX reads them -------------------------------
def _attributes(values: dict) -> attribute_map_pb2.AttributeMapProto:
    out = attribute_map_pb2.AttributeMapProto()
    for key, value in values.items():
        v = out.attributes[key]
        if isinstance(value, str):
            v.string_value = value.encode()
        elif isinstance(value, bool):
            v.bool_value = value
        elif isinstance(value, int):
            v.int64_value = value
        else:
            v.int64_list_value.elements.extend(value)
    return out


# A chip's memories (``MEMORY_KINDS``, as JAX names them): its own, the default
# ("device" on TPU and on JAX's CPU devices alike: an "unpinned_host" default would make
# JAX lower host offloading into every program), and its host's, pinned for DMA and not
# (host offload). Memory ``k`` of device ``d`` has id ``k * len(devices) + d``.
def init_response(session_id: int, devices: Sequence[ProxyDevice]) -> ifrt_pb2.InitResponse:
    """The session's devices, each with its memories, all addressable by the client."""
    platform = devices[0].platform if devices else "cpu"
    resp = ifrt_pb2.InitResponse(
        session_id=session_id, platform_name=platform, platform_version="pathways-ray",
        # "pathways" as Cloud Pathways' server says it (the client shows "proxy/pathways"):
        # Orbax and MaxText key their single-controller paths on it (persistence too).
        platform_id=0, process_index=0, runtime_type="pathways")
    for d in devices:
        resp.all_devices.append(ifrt_pb2.InitResponse.Device(
            id=d.id, local_device_id=d.id, local_hardware_id=d.rank, platform_name=d.platform,
            device_kind=d.device_kind, default_memory_id=d.id,
            memory_ids=[k * len(devices) + d.id for k in range(len(MEMORY_KINDS))],
            debug_string=d.describe(), to_string=d.describe(),
            attributes=_attributes({"slice_index": d.slice_index, "coords": list(d.coords),
                                    "core_on_chip": 0, "worker_id": d.worker_id,
                                    "slice_name": d.slice_name,
                                    "colocation_id": d.colocation_id})))
        for k, kind in enumerate(MEMORY_KINDS):
            resp.memories.append(ifrt_pb2.InitResponse.Memory(
                id=k * len(devices) + d.id, memory_space_kind=kind, kind_id=k,
                device_ids=[d.id], debug_string=f"{kind} of device {d.id}",
                to_string=f"{kind} of device {d.id}"))
        resp.addressable_device_ids.append(d.id)
        if d.colocated is None:  # (a chip's CPU device is not one of jax.devices())
            resp.primary_device_ids.append(d.id)
    return resp
