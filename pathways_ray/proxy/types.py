"""IFRT's value types as the proxy protocol carries them (dtype, shape, sharding), and
where a sharding puts an array on the session's slices. Pure: protobuf and numpy.

A sharding names devices of the session (``devices.ProxyDevice``); an array lives on
all chips of one slice, or of several slices of one JAX world (a layout: ``MeshShape``
and spec, any tile assignment XLA makes, over those chips slice after slice), or on
one device. A one-device array is kept on every chip of its device's slice, so that
the slice's programs can use it where they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from google.protobuf.message import DecodeError

from pathways_ray.client.arrays import MEMORY_KINDS
from pathways_ray.programs.hlo_sharding import MAXIMAL, REPLICATED, layout_of, replicated
from pathways_ray.programs.hlo_sharding import sharding_kind as _kind
from pathways_ray.programs.sharding import MeshShape, Spec
from pathways_ray.proxy.devices import ProxyDevice
from pathways_ray.proxy.errors import InvalidArgument, Unimplemented
from pathways_ray.proxy.protos import xla_python_ifrt_dtype_pb2 as dtype_pb2
from pathways_ray.proxy.protos import xla_python_ifrt_sharding_pb2 as sharding_pb2
from pathways_ray.proxy.protos import xla_python_ifrt_sharding_serdes_pb2 as serdes_pb2
from pathways_ray.proxy.protos import xla_python_pjrt_ifrt_xla_sharding_pb2 as xla_sharding_pb2
from pathways_ray.proxy.protos import xla_xla_data_pb2 as xla_data_pb2

__all__ = ["Placed", "ProxySharding", "dtype_of", "dtype_proto", "group_ranks",
           "hlo_sharding_proto", "parse_sharding", "place"]

# XLA's primitive type names -> numpy's (bfloat16 and the float8s from ml_dtypes).
NUMPY_DTYPES = {
    "PRED": "bool", "S8": "int8", "S16": "int16", "S32": "int32", "S64": "int64",
    "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "F16": "float16",
    "F32": "float32", "F64": "float64", "BF16": "bfloat16", "C64": "complex64",
    "C128": "complex128", "F8E4M3FN": "float8_e4m3fn", "F8E5M2": "float8_e5m2",
    "S4": "int4", "U4": "uint4"}
_KIND = {v: k for k, v in NUMPY_DTYPES.items()}


def dtype_of(proto) -> np.dtype:
    """``DTypeProto`` -> numpy dtype (bfloat16 and the float8s from ml_dtypes)."""
    try:
        name = dtype_pb2.DTypeProto.Kind.Name(proto.kind).removeprefix("KIND_")
    except ValueError:
        raise InvalidArgument(f"dtype kind {proto.kind} is not a dtype of IFRT's") from None
    if name not in NUMPY_DTYPES:
        raise Unimplemented(f"dtype {name} is not served by the pathways-ray proxy (it serves "
                         f"{', '.join(sorted(NUMPY_DTYPES))})")
    import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8s with numpy

    return np.dtype(NUMPY_DTYPES[name])


def dtype_proto(dtype) -> dtype_pb2.DTypeProto:
    if isinstance(dtype, np.dtypes.StringDType):  # (colocated Python's output specs)
        return dtype_pb2.DTypeProto(kind=dtype_pb2.DTypeProto.Kind.Value("KIND_STRING"))
    return dtype_pb2.DTypeProto(kind=dtype_pb2.DTypeProto.Kind.Value(
        "KIND_" + _KIND[np.dtype(dtype).name]))


@dataclass(frozen=True)
class ProxySharding:
    """A sharding as the client gave it: its devices in its order, and the tiling (an
    ``OpSharding``; None for one device or all of them holding everything)."""

    device_ids: tuple[int, ...]
    op: object | None = None
    memory_kind: str = "device"


# The memory kinds served: a chip's own memory ("" is the device's default) and its
# host's (JAX's kinds, as a TPU's and XLA's CPU devices have them).
SERVED_MEMORY_KINDS = ("", *MEMORY_KINDS)


def parse_sharding(proto: sharding_pb2.ShardingProto) -> ProxySharding:
    """``ShardingProto`` (one of IFRT's serialized sharding kinds) -> ``ProxySharding``;
    ``Unimplemented`` naming a kind of sharding or a memory kind that is not served."""
    kind, data = proto.serialized_sharding.type_name, proto.serialized_sharding.data
    try:
        if kind.endswith("SingleDeviceSharding"):
            m = serdes_pb2.SingleDeviceShardingProto.FromString(data)
            out = ProxySharding((m.device_id,), None, m.memory_kind)
        elif kind.endswith("::HloSharding"):
            m = xla_sharding_pb2.HloShardingProto.FromString(data)
            out = ProxySharding(tuple(m.devices.device_ids), m.xla_op_sharding, m.memory_kind)
        elif kind.endswith("ConcreteEvenSharding"):
            m = serdes_pb2.ConcreteEvenShardingProto.FromString(data)
            if not (m.is_fully_replicated or len(m.devices.device_ids) == 1):
                raise Unimplemented(f"a {kind} that is not replicated is not served by the "
                                    f"pathways-ray proxy: use a NamedSharding")
            out = ProxySharding(tuple(m.devices.device_ids), None, m.memory_kind)
        else:
            raise Unimplemented(f"a sharding of kind {kind!r} is not served by the "
                                f"pathways-ray proxy: use a NamedSharding (an HloSharding) or "
                                f"a single device")
    except DecodeError as e:
        raise InvalidArgument(f"a sharding of kind {kind!r} does not parse: {e}") from None
    if not out.device_ids:
        raise InvalidArgument(f"a sharding of kind {kind!r} over no devices")
    return replace(out, memory_kind=served_memory(out.memory_kind) or "device")


def served_memory(kind: str) -> str:
    """``kind``, a memory kind the client named; ``Unimplemented`` if not a chip's."""
    if kind not in SERVED_MEMORY_KINDS:
        raise Unimplemented(f"memory kind {kind!r} is not served by the pathways-ray proxy: "
                            f"a chip's memories are {', '.join(SERVED_MEMORY_KINDS[1:])}")
    return kind


def hlo_sharding_proto(device_ids: Sequence[int], op_bytes: bytes | None,
                       memory_kind: str = "") -> sharding_pb2.ShardingProto:
    """An IFRT ``HloSharding`` over ``device_ids`` (replicated when ``op_bytes`` is None)."""
    op = (xla_data_pb2.OpSharding.FromString(op_bytes) if op_bytes is not None
          else xla_data_pb2.OpSharding(type=REPLICATED))
    m = xla_sharding_pb2.HloShardingProto(xla_op_sharding=op, memory_kind=memory_kind)
    m.devices.device_ids.extend(device_ids)
    out = sharding_pb2.ShardingProto()
    out.serialized_sharding.type_name = "xla::ifrt::HloSharding"
    out.serialized_sharding.data = m.SerializeToString()
    return out


@dataclass(frozen=True)
class Placed:
    """Where a sharding puts an array: on the session's slices ``slices`` (one, or
    several of one JAX world), with a layout over all of their chips, slice after slice
    in rank order; ``device`` set for a one-device array (kept on every chip of its
    slice)."""

    slices: tuple[int, ...]
    mesh: MeshShape
    spec: Spec
    device: int | None = None


def group_ranks(slices: Sequence[int], chips: Sequence[int]) -> dict[int, int]:
    """Slice index -> the rank of its first chip among the chips of ``slices`` (slice
    after slice, in the order given)."""
    out, offset = {}, 0
    for s in slices:
        out[s] = offset
        offset += chips[s]
    return out


def place(sharding: ProxySharding, ndim: int, devices: Sequence[ProxyDevice],
          chips: Sequence[int], *, joint: bool = True) -> Placed:
    """``sharding`` of an ``ndim``-dimensional array on the session's ``devices``; its
    slices have ``chips[i]`` chips, one JAX world when ``joint``. ``InvalidArgument``
    naming what cannot be placed: an unknown device, devices of several slices of
    separate worlds, some of a slice's chips."""
    for d in sharding.device_ids:
        if not 0 <= d < len(devices):
            raise InvalidArgument(f"device {d} is not one of this session's {len(devices)} "
                                  f"devices (0..{len(devices) - 1})")
    slices = tuple(sorted({devices[d].slice_index for d in sharding.device_ids}))
    op = sharding.op
    if op is not None and _kind(op) == MAXIMAL:  # all of it on one of the devices
        if not (op.tile_assignment_devices
                and 0 <= op.tile_assignment_devices[0] < len(sharding.device_ids)):
            raise InvalidArgument(f"a MAXIMAL sharding's device "
                                  f"{list(op.tile_assignment_devices)[:1]} is not one of its "
                                  f"{len(sharding.device_ids)} devices")
        device = sharding.device_ids[int(op.tile_assignment_devices[0])]
        s = devices[device].slice_index
        return Placed((s,), *replicated(chips[s], ndim), device=device)
    if len(sharding.device_ids) == 1:
        device = sharding.device_ids[0]
        s = devices[device].slice_index
        return Placed((s,), *replicated(chips[s], ndim), device=device)
    if len(slices) > 1 and not joint:
        raise InvalidArgument(
            f"the sharding spans devices of slices "
            f"{sorted({devices[d].slice_name for d in sharding.device_ids})}, which are "
            f"separate JAX worlds in this session (slices leased from a shared service): "
            f"put each array on one slice's devices")
    first = group_ranks(slices, chips)
    ranks = [first[devices[d].slice_index] + devices[d].rank for d in sharding.device_ids]
    total = sum(chips[s] for s in slices)
    if op is None or _kind(op) == REPLICATED:
        if sorted(ranks) != list(range(total)):
            raise InvalidArgument(
                f"the sharding replicates over {len(ranks)} of the {total} chips of slices "
                f"{sorted({devices[d].slice_name for d in sharding.device_ids})}: arrays "
                f"here are on all chips of their slices or on one")
        return Placed(slices, *replicated(total, ndim))
    try:
        return Placed(slices, *layout_of(op, ranks, ndim, total))
    except (ValueError, IndexError) as e:  # a tiling that fits neither array nor slice
        raise InvalidArgument(f"the sharding is not a layout of a {ndim}-dimensional array "
                              f"on its slices' chips: {e}") from None
