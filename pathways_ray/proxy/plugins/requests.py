"""A plugin program's request, parsed and checked (pure: no JAX, no Ray).

pathwaysutils 0.1.13 sends an IFRT ``PluginProgram`` whose bytes are
``__serialized_plugin_program `` and one JSON object (measured through the proxy):

- ``bulk_persistence_write_request`` / ``persistenceWriteRequest``: write arrays
  (the program's arguments) to ``<location>/<name>``, each chip its own shards
  (``pathwaysutils.persistence``; Orbax's ``CloudPathwaysArrayHandler`` with
  ``ENABLE_PATHWAYS_PERSISTENCE=1``);
- ``bulk_persistence_read_request`` / ``persistenceReadRequest``: read such arrays
  into the program's results, with the shardings given;
- ``profileRequest``: a trace of the workers; the first run starts it, the second
  stops it and writes it at ``traceLocation`` (``pathwaysutils.profiling``);
- ``reshardRequest``: the arguments moved to other shardings (the "sidechannel"
  reshard of ``pathwaysutils.experimental.reshard``).
"""

from __future__ import annotations

import base64
import binascii
import json
import posixpath
from dataclasses import dataclass

from pathways_ray.proxy.errors import InvalidArgument, Unimplemented
from pathways_ray.proxy.types import NUMPY_DTYPES as DTYPES

__all__ = ["PREFIX", "Persist", "Persistence", "Profile", "Reshard", "Target", "parse"]

PREFIX = b"__serialized_plugin_program "
MAX_BYTES = 64 << 20
MAX_ARRAYS = 100_000
DEFAULT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Persist:
    """One array of a persistence request: at ``location/name``, of ``shape`` over the
    client's devices ``device_ids`` tiled as ``op`` (``OpSharding`` bytes); ``dtype``
    for a read (a write's comes with its array)."""

    location: str
    name: str
    shape: tuple[int, ...]
    op: bytes
    device_ids: tuple[int, ...]
    dtype: str | None
    timeout_s: float


@dataclass(frozen=True)
class Persistence:
    write: bool
    arrays: tuple[Persist, ...]

    @property
    def timeout_s(self) -> float:
        return max(a.timeout_s for a in self.arrays)


@dataclass(frozen=True)
class Profile:
    location: str


@dataclass(frozen=True)
class Target:
    """A sharding as a reshard request names it: the client's devices, the tiling
    (``OpSharding`` bytes) and the memory kind ("" for the default)."""

    device_ids: tuple[int, ...]
    op: bytes
    memory_kind: str


@dataclass(frozen=True)
class Reshard:
    sources: tuple[Target, ...]
    targets: tuple[Target, ...]
    donate: bool


def parse(data: bytes) -> Persistence | Profile | Reshard:
    """A ``PluginProgram``'s bytes -> its request; ``InvalidArgument`` naming what is
    malformed, ``Unimplemented`` naming a request this server does not run."""
    if len(data) > MAX_BYTES:
        raise InvalidArgument(f"a plugin program of {len(data)} bytes (at most {MAX_BYTES})")
    if not data.startswith(PREFIX):
        raise InvalidArgument(f"a plugin program that does not start with {PREFIX.decode()!r}")
    try:
        body = json.loads(data[len(PREFIX):])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"a plugin program whose request is not JSON: {e}") from None
    if not isinstance(body, dict) or len(body) != 1:
        raise InvalidArgument("a plugin program's request must be a JSON object of one key "
                              "(its kind)")
    (kind, value), = body.items()
    if not isinstance(value, dict):
        raise InvalidArgument(f"plugin request {kind!r} is not a JSON object")
    if kind in ("persistenceWriteRequest", "persistenceReadRequest"):
        write = kind == "persistenceWriteRequest"
        return Persistence(write, (_persist(value, write, kind),))
    if kind in ("bulk_persistence_write_request", "bulk_persistence_read_request"):
        write = kind == "bulk_persistence_write_request"
        field = "write_requests" if write else "read_requests"
        items = value.get(field)
        if not isinstance(items, list) or not items or len(items) > MAX_ARRAYS:
            raise InvalidArgument(f"{kind}.{field} must be a list of 1..{MAX_ARRAYS} requests")
        return Persistence(write, tuple(_persist(v, write, f"{kind}.{field}[{i}]")
                                        for i, v in enumerate(items)))
    if kind == "profileRequest":
        location = value.get("traceLocation")
        if not isinstance(location, str) or not location:
            raise InvalidArgument("profileRequest.traceLocation must name a directory")
        return Profile(_location(location, "profileRequest.traceLocation"))
    if kind == "reshardRequest":
        ins, outs = value.get("inSharding"), value.get("outSharding")
        if (not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs)
                or not 0 < len(outs) <= MAX_ARRAYS):
            raise InvalidArgument("reshardRequest.inSharding and .outSharding must be lists "
                                  f"of the same length, 1..{MAX_ARRAYS}")
        return Reshard(tuple(_target(t, f"reshardRequest.inSharding[{i}]")
                             for i, t in enumerate(ins)),
                       tuple(_target(t, f"reshardRequest.outSharding[{i}]")
                             for i, t in enumerate(outs)),
                       bool(value.get("donateInput", False)))
    raise Unimplemented(f"plugin request {kind!r} is not served by the pathways-ray proxy "
                        f"(served: persistence writes and reads, profileRequest, "
                        f"reshardRequest)")


def _target(value, where: str) -> Target:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} is not a JSON object")
    ids = _device_ids(value, where)
    kind = value.get("memory_kind", "")
    if not isinstance(kind, str):
        raise InvalidArgument(f"{where}.memory_kind must be a string")
    return Target(ids, _b64(value, "xla_hlo_sharding", where), kind)


def _persist(value, write: bool, where: str) -> Persist:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} is not a JSON object")
    location = _location(_b64_text(value, "b64_location", where), f"{where}.b64_location")
    name = _b64_text(value, "b64_name", where)
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidArgument(f"{where}.b64_name={name!r}: an array's name is a relative "
                              f"path inside its location, without '.' or '..' parts")
    op = _b64(value, "b64_hlo_sharding_string", where)
    shape_field = value.get("shape")
    dtype = None
    if write:
        dims = shape_field
    else:  # {"xla_primitive_type_str", "dimensions"}
        if not isinstance(shape_field, dict):
            raise InvalidArgument(f"{where}.shape must be an object of xla_primitive_type_str "
                                  f"and dimensions")
        dims = shape_field.get("dimensions", [])
        kind = shape_field.get("xla_primitive_type_str")
        if kind not in DTYPES:
            raise InvalidArgument(f"{where}.shape.xla_primitive_type_str={kind!r}: one of "
                                  f"{sorted(DTYPES)}")
        dtype = DTYPES[kind]
    if (not isinstance(dims, list) or len(dims) > 64
            or not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in dims)):
        raise InvalidArgument(f"{where}.shape={str(dims)[:80]}: a list of dimensions >= 0")
    return Persist(location, name, tuple(dims), op, _device_ids(value, where), dtype,
                   _timeout(value, where))


def _device_ids(value: dict, where: str) -> tuple[int, ...]:
    devices = value.get("devices", {})
    ids = devices.get("device_ids") if isinstance(devices, dict) else None
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(d, int) and d >= 0 for d in ids)):
        raise InvalidArgument(f"{where}.devices.device_ids must be a non-empty list of "
                              f"device ids")
    return tuple(ids)


def _location(text: str, where: str) -> str:
    """A directory every host can reach: an absolute path, or a URL (``gs://...``)."""
    if "://" in text:
        scheme = text.split("://", 1)[0]
        if not scheme.isalnum():
            raise InvalidArgument(f"{where}={text!r}: not a URL")
        return text
    if not text.startswith("/") or ".." in text.split("/"):
        raise InvalidArgument(f"{where}={text!r}: a location is an absolute path or a "
                              f"bucket URL (gs://...), without '..'")
    return posixpath.normpath(text)


def _b64(value: dict, key: str, where: str) -> bytes:
    text = value.get(key)
    if not isinstance(text, str):
        raise InvalidArgument(f"{where}.{key} is missing")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{where}.{key} is not base64") from None


def _b64_text(value: dict, key: str, where: str) -> str:
    try:
        return _b64(value, key, where).decode()
    except UnicodeDecodeError:
        raise InvalidArgument(f"{where}.{key} is not UTF-8 text") from None


def _timeout(value: dict, where: str) -> float:
    t = value.get("timeout")
    if t is None:
        return DEFAULT_TIMEOUT_S
    if not isinstance(t, dict):
        raise InvalidArgument(f"{where}.timeout must be {{seconds, nanos}}")
    parts = (t.get("seconds", 0), t.get("nanos", 0))
    seconds = (parts[0] + parts[1] / 1e9 if all(isinstance(p, int | float) for p in parts)
               else -1)
    if not 0 < seconds <= 7 * 24 * 3600:
        raise InvalidArgument(f"{where}.timeout={t}: between 0 and 7 days")
    return float(seconds)
