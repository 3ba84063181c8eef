"""A compiled plugin program of a session, run on its chips.

- A persistence write sends one ``Save(each=True)`` per slice the arrays are on: every
  chip writes its own shards to ``<location>/<name>`` (TensorStore, as Orbax's
  ``ArrayHandler`` lays an array out); no array byte passes through the proxy. Its
  status is done when every chip's is.
- A persistence read makes the results at once (handles) and sends one
  ``Restore(each=True)`` per slice and mesh: every chip reads its own shards.
- A reshard request moves each argument to its target sharding as IFRT's reshard
  does (``ArrayTable.reshard``: chip to chip between slices).
- A profile request starts the session client's profile (every chip's JAX profiler,
  the controller's and the client's spans) on its first run and, on its second, stops
  it and writes the merged trace under ``<traceLocation>/plugins/profile/<run>/``, as
  ``pathways-ray profile`` does.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from pathways_ray.client.arrays import RemoteArray
from pathways_ray.proxy.arrays import ArrayTable, ProxyArray
from pathways_ray.proxy.errors import InvalidArgument, PermissionDenied
from pathways_ray.proxy.plugins.requests import Persistence, Profile, Reshard, parse
from pathways_ray.proxy.protos import xla_xla_data_pb2 as xla_data_pb2
from pathways_ray.proxy.types import ProxySharding
from pathways_ray.transport.commands import Restore, Save

__all__ = ["PluginExecutable", "allowed", "compile_plugin"]

logger = logging.getLogger(__name__)


@dataclass
class PluginExecutable:
    request: Persistence | Profile | Reshard
    device_ids: tuple[int, ...]
    name: str
    _profile: object | None = None  # a running profile (observability.profiling.Profile)

    def execute(self, table: ArrayTable, args: list[ProxyArray]
                ) -> tuple[list[ProxyArray], Callable[[], None]]:
        """Start the program; its results (handles, at once) and a wait for its end."""
        if isinstance(self.request, Profile):
            return [], self._toggle_profile(table)
        if isinstance(self.request, Reshard):
            return _reshard(table, self.request, args)
        if self.request.write:
            return [], _write(table, self.request, args)
        if args:
            raise InvalidArgument(f"a persistence read takes no arguments, got {len(args)}")
        return _read(table, self.request)

    def _toggle_profile(self, table: ArrayTable) -> Callable[[], None]:
        from pathways_ray.observability.profiling import Profile as ClientProfile

        if self._profile is None:
            self._profile = ClientProfile(table.client, self.request.location).start()
            logger.info("profile started; it goes to %s", self.request.location)
            return lambda: None
        running, self._profile = self._profile, None
        return lambda: _stop(running)

    def close(self) -> None:
        """Stop a profile its client left running (and write it, as asked): the chips'
        profilers would otherwise stay on under the next session of a warm client,
        whose own profile could then not start."""
        running, self._profile = self._profile, None
        if running is not None:
            logger.info("a session ended with its profile running: stopping it")
            try:
                _stop(running)
            except Exception as e:  # noqa: BLE001 - a lost slice, a full disk: said, not raised
                logger.warning("the profile left running could not be written: %s", e)


def _stop(running) -> None:
    paths = running.stop()
    logger.info("profile written: %s", ", ".join(paths.values()))


def allowed(location: str, roots: tuple[str, ...]) -> bool:
    """Whether ``location`` is under one of ``roots`` (directories, or URL prefixes)."""
    for root in roots:
        if "://" in root:  # "gs://": any bucket; "gs://team/ckpt": that folder and below
            if root.endswith("://") and location.startswith(root):
                return True
            if location == root.rstrip("/") or location.startswith(root.rstrip("/") + "/"):
                return True
        elif "://" not in location and posixpath.commonpath(
                [posixpath.normpath(root), location]) == posixpath.normpath(root):
            return True
    return False


def compile_plugin(table: ArrayTable, data: bytes) -> PluginExecutable:
    """The request of ``data``, checked against this server's storage roots (the chips
    write and read only where ``$PATHWAYS_RAY_PROXY_STORAGE`` allows)."""
    from pathways_ray.config import STORAGE_ENV, storage_roots

    request = parse(data)
    # The executable's devices are its first argument's: jaxlib's client hands every
    # argument over as that many shards (Orbax groups its writes by devices for this).
    if isinstance(request, Reshard):
        return PluginExecutable(request, _known(table, request.sources[0].device_ids),
                                "reshard")
    roots = storage_roots()
    where = ([request.location] if isinstance(request, Profile)
             else sorted({a.location for a in request.arrays}))
    for location in where:
        if not allowed(location, roots):
            raise PermissionDenied(f"location {location!r} is outside what this server lets "
                                   f"clients write and read: {list(roots)} (its "
                                   f"${STORAGE_ENV}, or pathways-ray proxy --storage)")
    if isinstance(request, Profile):
        return PluginExecutable(request, tuple(range(len(table.devices))), "profile")
    for a in request.arrays:
        _known(table, a.device_ids)
    return PluginExecutable(request, request.arrays[0].device_ids,
                            "persistence_write" if request.write else "persistence_read")


def _known(table: ArrayTable, device_ids: tuple[int, ...]) -> tuple[int, ...]:
    for d in device_ids:
        if d >= len(table.devices):
            raise InvalidArgument(f"a plugin request names device {d}; this session has "
                                  f"{len(table.devices)} devices")
    return device_ids


def _write(table: ArrayTable, req: Persistence, args: list[ProxyArray]) -> Callable[[], None]:
    if len(args) != len(req.arrays):
        raise InvalidArgument(f"a persistence write of {len(req.arrays)} arrays was given "
                              f"{len(args)}")
    client = table.client
    groups: dict[tuple[str, str], list[tuple[str, RemoteArray]]] = {}
    for i, (one, arr) in enumerate(zip(req.arrays, args, strict=True)):
        if tuple(arr.shape) != one.shape:
            raise InvalidArgument(f"array {i} ({one.name!r}) is {list(arr.shape)}; the "
                                  f"request writes {list(one.shape)}")
        remote = table.on_chips(arr, arr.placed.slices)
        groups.setdefault((remote.slice, one.location), []).append((one.name, remote))
    statuses = []
    for (where, location), items in groups.items():
        client._check(where)
        mesh = items[0][1].mesh
        status = RemoteArray(client, next(client._ids), where, (), "int32", mesh, ())
        client._queue.enqueue(where, Save(location, tuple((n,) for n, _ in items),
                                          tuple(r._id for _, r in items), status._id, mesh,
                                          each=True))
        statuses.append(status)
        logger.info("persistence write of %d arrays to %s by the chips of %s", len(items),
                    location, where)
    return lambda: client.block_until_ready(statuses, req.timeout_s)


def _reshard(table: ArrayTable, req: Reshard, args: list[ProxyArray]
             ) -> tuple[list[ProxyArray], Callable[[], None]]:
    from pathways_ray.proxy.types import served_memory

    if len(args) != len(req.targets):
        raise InvalidArgument(f"a reshard of {len(req.targets)} arrays was given {len(args)}")
    outs = []
    for i, (arr, target) in enumerate(zip(args, req.targets, strict=True)):
        outs.append(table.reshard(arr, ProxySharding(
            target.device_ids, _op(target.op, f"target {i}"),
            served_memory(target.memory_kind) or "device")))
    return outs, lambda: table.ready(outs)


def _op(data: bytes, what: str):
    try:
        return xla_data_pb2.OpSharding.FromString(data)
    except DecodeError as e:
        raise InvalidArgument(f"the sharding of {what} does not parse: {e}") from None


def _read(table: ArrayTable, req: Persistence) -> tuple[list[ProxyArray], Callable[[], None]]:
    import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8s with numpy

    client = table.client
    outs, groups = [], {}
    for one in req.arrays:
        op = _op(one.op, repr(one.name))
        placed = table.place(ProxySharding(one.device_ids, op), len(one.shape))
        where = table.name(placed.slices)
        remote = RemoteArray(client, next(client._ids), where, one.shape, one.dtype,
                             placed.mesh, placed.spec)
        groups.setdefault((where, one.location, placed.mesh), []).append((one, remote))
        outs.append(ProxyArray(one.shape, np.dtype(one.dtype), placed, one.device_ids, op,
                               remote=remote))
    for (where, location, mesh), items in groups.items():
        client._check(where)
        client._queue.enqueue(where, Restore(
            location, tuple((o.name,) for o, _ in items), tuple(r._id for _, r in items),
            tuple(o.shape for o, _ in items), tuple(o.dtype for o, _ in items),
            tuple(r.spec for _, r in items), mesh, each=True))
    return outs, lambda: table.ready(outs, req.timeout_s)
