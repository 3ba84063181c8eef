"""Colocated Python: user code on every host of a slice, next to its chips.

``client.sidecar(fn_or_class, slice=...)`` sends a function or a class to the
sidecar process of every host of a slice (``sidecar_host.SidecarHost``), in the
spirit of ``jax.experimental.colocated_python``::

    def read_tokens(host, step):           # runs on each host of the slice
        rows = host.box[0]                 # the rows of the batch this host holds
        return tokenize(read_shard(step, rows.start, rows.stop))

    batch_spec = jax.ShapeDtypeStruct((B, T), np.int32, sharding=NamedSharding(mesh, P("data")))
    load = client.sidecar(read_tokens, slice=0).returning(batch_spec)
    batch = load(step)                     # a RemoteArray; its bytes never left the hosts

Every call's first argument is the ``Host`` it runs on: its TPU worker id, its
chips, and for each output the block of the global array it must return
(``host.boxes``). ``RemoteArray`` arguments arrive as ``HostArray``: the host's
own shards, handed over by its chip workers through the node's object store.
A class is instantiated on every host (``client.sidecar(Loader)(args...)``) and
keeps its state between calls; calls on one object run in the order they were
made. Calls are queued with the slice's other commands and return at once:
issue the next batch's load before the step that needs it and it is read while
the step runs. A call without ``.returning(...)`` gives a ``HostResults`` of
what each host returned (small values: a count of bytes written, a path).

Errors: user code that raises comes back as ``RemoteError`` with the host's
traceback (where the output is fetched or used, or from ``result()``); the
slice stays usable. A sidecar that dies or freezes is a lost host: its slice
becomes ``SliceLost``.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pathways_ray.chips.sidecar_host import Host, HostArray, _Arg
from pathways_ray.client.arrays import Layout, RemoteArray, spec_of
from pathways_ray.transport.commands import HostCall, Put

if TYPE_CHECKING:
    from pathways_ray.client.client import Client

__all__ = ["ArrayOut", "Host", "HostArray", "HostResults", "SidecarClass", "SidecarFunction",
           "SidecarObject"]

_objects = itertools.count(1)


def new_object_id() -> int:
    """A new id for calls that run in order on a slice's hosts (an object's, or an
    ordered stream's of calls: a ``SidecarFunction`` with this ``obj``)."""
    return next(_objects)


class HostResults:
    """What each host's call returned, in TPU worker id order (``result()``)."""

    def __init__(self, client: Client, slice_name: str, reply: int, name: str):
        self._client, self._slice, self._reply, self._name = client, slice_name, reply, name
        self._value: list | None = None

    def result(self, timeout_s: float | None = None) -> list:
        """Wait up to ``timeout_s`` (default ``$PATHWAYS_RAY_FETCH_TIMEOUT_S``)."""
        if self._value is None:
            self._value = self._client._host_results(self._slice, self._reply, timeout_s,
                                                     f"sidecar {self._name}")
        return self._value


class SidecarFunction:
    """A function (or an object's method) that runs on every host of a slice."""

    def __init__(self, client: Client, slice_name: str, name: str, kind: str, *,
                 target=None, obj: int | None = None, method: str | None = None,
                 out=None):
        self._client, self.slice, self.name = client, slice_name, name
        self._kind, self._target, self._obj, self._method = kind, target, obj, method
        self._out = out

    def returning(self, out) -> SidecarFunction:
        """The same call, whose results become arrays on the slice: ``out`` is a
        ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(client.mesh(...),
        spec))`` or a pytree of them; each host returns its block of each
        (``host.boxes``), as one array or a tuple in ``out``'s leaf order."""
        _out_leaves(out, self._client._chips[self.slice], self.name)  # checks
        return SidecarFunction(self._client, self.slice, self.name, self._kind,
                               target=self._target, obj=self._obj, method=self._method,
                               out=out)

    def __call__(self, *args, **kwargs):
        spec = {"kind": self._kind, "target": self._target, "obj": self._obj,
                "method": self._method, "name": self.name}
        return self._client._host_call(self.slice, spec, args, kwargs, self._out)

    def __repr__(self) -> str:
        return f"SidecarFunction({self.name!r}, slice={self.slice!r})"


class SidecarClass:
    """``client.sidecar(cls)``: calling it makes an instance on every host of the slice
    (``cls(host, *args, **kwargs)``) and returns a ``SidecarObject``."""

    def __init__(self, client: Client, slice_name: str, cls: type):
        self._client, self.slice, self.cls = client, slice_name, cls

    def __call__(self, *args, timeout_s: float | None = None, **kwargs) -> SidecarObject:
        obj = new_object_id()
        name = self.cls.__name__
        made = self._client._host_call(self.slice, {"kind": "new", "target": self.cls,
                                                    "obj": obj, "name": f"{name}()"},
                                       args, kwargs, None)
        made.result(timeout_s)  # a constructor that raises does so here
        return SidecarObject(self._client, self.slice, self.cls, obj)


class SidecarObject:
    """An instance of a class on every host of a slice: ``obj.method(...)`` calls it on
    each (``obj.method.returning(out)(...)`` for arrays); ``close()`` drops it."""

    def __init__(self, client: Client, slice_name: str, cls: type, obj: int):
        self._client, self.slice, self._cls, self._obj = client, slice_name, cls, obj
        self._closed = False

    def __getattr__(self, name: str) -> SidecarFunction:
        if name.startswith("_") or not callable(getattr(self._cls, name, None)):
            raise AttributeError(f"{self._cls.__name__} has no method {name!r}")
        if self._closed:
            raise RuntimeError(f"this {self._cls.__name__} sidecar object is closed")
        return SidecarFunction(self._client, self.slice, f"{self._cls.__name__}.{name}",
                               "method", obj=self._obj, method=name)

    def close(self, timeout_s: float | None = None) -> list:
        """Drop the instance on every host (calling its ``close()`` if it has one);
        returns what each host's ``close()`` returned."""
        if self._closed:
            return []
        self._closed = True
        return self._client._host_call(self.slice, {"kind": "del", "obj": self._obj,
                                                    "name": f"{self._cls.__name__}.close"},
                                       (), {}, None).result(timeout_s)


def make(client: Client, target, slice_name: str):
    """``client.sidecar``'s work, once the slice's sidecars run."""
    if inspect.isclass(target):
        return SidecarClass(client, slice_name, target)
    if callable(target):
        return SidecarFunction(client, slice_name, getattr(target, "__qualname__", "fn"),
                               "fn", target=target)
    raise TypeError(f"client.sidecar({target!r}): pass a function or a class")


@dataclass(frozen=True)
class ArrayOut:
    """An output in pathways-ray's own terms, where ``returning`` takes a
    ``jax.ShapeDtypeStruct``: a ``Layout`` over the slice's chips (the IFRT proxy's)."""

    shape: tuple[int, ...]
    dtype: object
    sharding: Layout


def _out_leaves(out, chips: int, name: str) -> list:
    """The leaves of ``out``, checked: ShapeDtypeStructs with a sharding over ``chips``."""
    import jax

    leaves = jax.tree.leaves(out)
    if not leaves:
        raise ValueError(f"returning(out={out!r}) for sidecar {name}: give a "
                         f"jax.ShapeDtypeStruct or a pytree of them")
    for leaf in leaves:
        if not isinstance(leaf, (jax.ShapeDtypeStruct, ArrayOut)) or leaf.sharding is None:
            raise ValueError(f"returning(out=...) for sidecar {name}: {leaf!r} must be a "
                             f"jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding("
                             f"client.mesh(...), PartitionSpec(...)))")
        mesh, _ = spec_of(leaf.sharding, len(leaf.shape))
        if mesh.size != chips:
            raise ValueError(f"returning(out=...) for sidecar {name}: the mesh has {mesh.size} "
                             f"devices; the slice has {chips} chips")
    return leaves


def build_call(client: Client, target: str, spec: dict, args: tuple, kwargs: dict, out):
    """The ``HostCall`` for a call and its output handles (a pytree, or None).
    ``RemoteArray`` arguments (at the top level, or in a list, tuple or dict) become
    the host's shards, copied at this point of the slice's stream (``Hold``), so the
    caller may drop them at once; everything else is pickled as is."""
    import jax
    import numpy as np

    inputs: list[tuple] = []

    def sub(v):
        if isinstance(v, RemoteArray):
            client._own(v)
            if v.slice != target:
                raise ValueError(f"sidecar {spec['name']} runs on slice {target}; argument "
                                 f"{v!r} lives on {v.slice}: move it with "
                                 f"pathways_ray.reshard(x, sharding, slice={target!r})")
            inputs.append((v._id, v.shape, v.dtype.name, v.mesh, v.spec))
            return _Arg(len(inputs) - 1)
        if isinstance(v, (list, tuple)) and any(isinstance(x, RemoteArray) for x in v):
            return type(v)(sub(x) for x in v)
        if isinstance(v, dict) and any(isinstance(x, RemoteArray) for x in v.values()):
            return {k: sub(x) for k, x in v.items()}
        return v

    spec = {**spec, "args": tuple(sub(a) for a in args),
            "kwargs": {k: sub(v) for k, v in kwargs.items()}}
    puts, handles = [], None
    if out is not None:
        leaves = _out_leaves(out, client._chips[target], spec["name"])
        arrays = []
        for leaf in leaves:
            mesh, pspec = spec_of(leaf.sharding, len(leaf.shape))
            a = RemoteArray(client, next(client._ids), target, leaf.shape, leaf.dtype, mesh,
                            pspec)
            puts.append(Put(a._id, tuple(leaf.shape), np.dtype(leaf.dtype).name, pspec, mesh))
            arrays.append(a)
        handles = jax.tree.unflatten(jax.tree.structure(out), arrays)
    reply = 0 if out is not None else next(client._ids)
    spec["reply"] = bool(reply)
    return HostCall(spec, tuple(inputs), tuple(puts), reply), handles
