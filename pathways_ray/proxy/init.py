"""The ``InitResponse`` of a session: its devices as JAX reads them (one per chip, with
``slice_index`` and ``coords``), each with one memory, all addressable by the client."""

from __future__ import annotations

from collections.abc import Sequence

from pathways_ray.proxy.devices import ProxyDevice
from pathways_ray.proxy.protos import xla_python_ifrt_attribute_map_pb2 as attribute_map_pb2
from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2

__all__ = ["init_response"]


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


def init_response(session_id: int, devices: Sequence[ProxyDevice]) -> ifrt_pb2.InitResponse:
    """The session's devices, each with one memory, all addressable by the client."""
    platform = devices[0].platform if devices else "cpu"
    resp = ifrt_pb2.InitResponse(
        session_id=session_id, platform_name=platform, platform_version="pathways-ray",
        platform_id=0, process_index=0, runtime_type="pathways-ray")
    for d in devices:
        resp.all_devices.append(ifrt_pb2.InitResponse.Device(
            id=d.id, local_device_id=d.id, local_hardware_id=d.rank, platform_name=d.platform,
            device_kind=d.device_kind, default_memory_id=d.id, memory_ids=[d.id],
            debug_string=d.describe(), to_string=d.describe(),
            attributes=_attributes({"slice_index": d.slice_index, "coords": list(d.coords),
                                    "core_on_chip": 0, "worker_id": d.worker_id,
                                    "slice_name": d.slice_name})))
        resp.memories.append(ifrt_pb2.InitResponse.Memory(
            id=d.id, memory_space_kind=d.memory_kind, kind_id=0, device_ids=[d.id],
            debug_string=f"{d.memory_kind} of device {d.id}",
            to_string=f"{d.memory_kind} of device {d.id}"))
        resp.addressable_device_ids.append(d.id)
        resp.primary_device_ids.append(d.id)
    return resp
