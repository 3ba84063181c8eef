"""A compiled plugin program of a session, run on its chips.

- A persistence write sends one ``Save(each=True)`` per slice the arrays are on: every
  chip writes its own shards to ``<location>/<name>`` (TensorStore, as Orbax's
  ``ArrayHandler`` lays an array out); no array byte passes through the proxy. Its
  status is done when every chip's is.
- A persistence read makes the results at once (handles) and sends one
  ``Restore(each=True)`` per slice and mesh: every chip reads its own shards.
- A profile request starts the session client's profile (every chip's JAX profiler,
  the controller's and the client's spans) on its first run and, on its second, stops
  it and writes the merged trace under ``<traceLocation>/plugins/profile/<run>/``, as
  ``pathways-ray profile`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from pathways_ray.client.arrays import RemoteArray
from pathways_ray.proxy.arrays import ArrayTable, ProxyArray
from pathways_ray.proxy.errors import InvalidArgument
from pathways_ray.proxy.plugins.requests import Persistence, Profile, parse
from pathways_ray.proxy.protos import xla_xla_data_pb2 as xla_data_pb2
from pathways_ray.proxy.types import ProxySharding
from pathways_ray.transport.commands import Restore, Save

__all__ = ["PluginExecutable", "compile_plugin"]

logger = logging.getLogger(__name__)


@dataclass
class PluginExecutable:
    request: Persistence | Profile
    device_ids: tuple[int, ...]
    name: str
    out_shapes: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    _profile: object | None = None  # a running profile (observability.profiling.Profile)

    def execute(self, table: ArrayTable, args: list[ProxyArray]
                ) -> tuple[list[ProxyArray], Callable[[], None]]:
        """Start the program; its results (handles, at once) and a wait for its end."""
        if isinstance(self.request, Profile):
            return [], self._toggle_profile(table)
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

        def stop() -> None:
            paths = running.stop()
            logger.info("profile written: %s", ", ".join(paths.values()))

        return stop


def compile_plugin(table: ArrayTable, data: bytes) -> PluginExecutable:
    request = parse(data)
    if isinstance(request, Profile):
        return PluginExecutable(request, tuple(range(len(table.devices))), "profile")
    devices = sorted({d for a in request.arrays for d in a.device_ids})
    for d in devices:
        if d >= len(table.devices):
            raise InvalidArgument(f"a persistence request names device {d}; this session "
                                  f"has {len(table.devices)} devices")
    outs = [] if request.write else [(a.shape, a.dtype) for a in request.arrays]
    return PluginExecutable(request, tuple(devices),
                            "persistence_write" if request.write else "persistence_read",
                            outs)


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


def _read(table: ArrayTable, req: Persistence) -> tuple[list[ProxyArray], Callable[[], None]]:
    import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8s with numpy

    client = table.client
    outs, groups = [], {}
    for one in req.arrays:
        try:
            op = xla_data_pb2.OpSharding.FromString(one.op)
        except DecodeError as e:
            raise InvalidArgument(f"the sharding of {one.name!r} does not parse: {e}") from None
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
