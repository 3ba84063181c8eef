"""The sidecar process on one TPU host: the user's Python next to the host's chips.

One ``SidecarHost`` actor per host of a slice, in the slice's placement group on
the same Ray node as the host's chip workers (``Slice.sidecars``). It runs the
functions and holds the objects that ``client.sidecar(...)`` sends it, in the
spirit of ``jax.experimental.colocated_python``:

- what a call returns for this host becomes this host's chips' shards of new
  arrays: cut into one object per distinct chip block and put in this node's
  object store, where the chip workers read them (shared memory); the bytes
  never pass through the client or the controller;
- array arguments arrive as this host's shards (``HostArray``), handed over
  by the chip workers through the same store.

Calls on one object run in the order the client made them (a data iterator
keeps its position); other calls run side by side (``max_concurrency``), so
a checkpoint write does not hold up the next batch. An exception in user code
comes back as ``RemoteError`` with this host's traceback. No JAX here.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pathways_ray import boundary
from pathways_ray.config import timeout_s
from pathways_ray.errors import PathwaysError, RemoteError, WaitTimeout

__all__ = ["Host", "HostArray", "SidecarHost"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Host:
    """What a sidecar call knows of the host it runs on (its first argument).

    ``boxes[i]`` is the block of the call's ``i``-th output array this host must
    return (the bounding box of its chips' shards: ``arr[box]`` of the global
    array); ``box`` is the first one's. ``state`` is a dict that lives as long as
    the sidecar, shared by every function call on this host.
    """

    slice_name: str
    worker_id: int
    num_hosts: int
    chips: tuple[int, ...]  # the ranks of the slice's chips on this host
    boxes: tuple[tuple[slice, ...], ...] = ()
    state: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def box(self) -> tuple[slice, ...]:
        if not self.boxes:
            raise ValueError("this call returns no arrays (call .returning(...) for some), so "
                             "it has no box")
        return self.boxes[0]


@dataclass(frozen=True)
class HostArray:
    """This host's shards of an array argument: ``(index, block)`` pairs, one per
    distinct block its chips hold (``arr[index] == block`` of the global array)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    shards: tuple[tuple[tuple[slice, ...], np.ndarray], ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for _, b in self.shards)


@dataclass(frozen=True)
class _Out:
    """One output of a call on this host: the block to return and how to cut it."""

    shape: tuple[int, ...]
    dtype: str
    box: tuple[slice, ...]
    pieces: tuple[tuple[slice, ...], ...]  # distinct chip blocks, in return order


class _Arg:
    """Placeholder in a call's arguments for its ``i``-th array input."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return (_Arg, (self.i,))


class SidecarHost:
    """Create with ``ray.remote(SidecarHost)`` in the slice's placement group."""

    def __init__(self, slice_name: str, worker_id: int, num_hosts: int, chips: list[int],
                 settings: dict | None = None):
        os.environ.update(settings or {})  # its controller's (config.settings_env)
        self.slice_name, self.worker_id = slice_name, worker_id
        self.num_hosts, self.chips = num_hosts, tuple(chips)
        self.objects: dict[int, Any] = {}
        self.state: dict = {}
        self._turn: dict[int, int] = {}  # object id -> sequence number of its next call
        self._cond = threading.Condition()
        self.calls = 0

    def ping(self) -> int:
        return os.getpid()

    def call(self, spec: dict, inputs: list):
        """Run one call (see ``sidecar.py`` for ``spec``); returns the output pieces, and
        the user's return value last when ``spec["reply"]``."""
        obj = spec.get("obj")
        if obj is not None:
            self._wait_turn(obj, spec["seq"], spec["name"])
        try:
            return self._call(spec, inputs)
        finally:
            if obj is not None:
                with self._cond:
                    self._turn[obj] = spec["seq"] + 1
                    self._cond.notify_all()

    def _wait_turn(self, obj: int, seq: int, name: str) -> None:
        wait_s = timeout_s("stream")
        with self._cond:
            if not self._cond.wait_for(lambda: self._turn.get(obj, 0) == seq, timeout=wait_s):
                raise WaitTimeout(f"sidecar call {name} (#{seq}) waited {wait_s:g} s for the "
                                  f"calls before it on host {self._where} "
                                  f"($PATHWAYS_RAY_STREAM_TIMEOUT_S)")

    @property
    def _where(self) -> str:
        return f"{self.slice_name}/{self.worker_id}"

    def _call(self, spec: dict, inputs: list):
        self.calls += 1
        arrays = self._inputs(spec, inputs)
        outs: list[_Out] = spec["outs"]
        host = Host(self.slice_name, self.worker_id, self.num_hosts, self.chips,
                    tuple(o.box for o in outs), self.state)
        args = tuple(_resolve(a, arrays) for a in spec["args"])
        kwargs = {k: _resolve(v, arrays) for k, v in spec["kwargs"].items()}
        try:
            match spec["kind"]:
                case "fn":
                    value = spec["target"](host, *args, **kwargs)
                case "new":
                    self.objects[spec["obj"]] = spec["target"](host, *args, **kwargs)
                    value = None
                case "method":
                    value = getattr(self._object(spec), spec["method"])(host, *args, **kwargs)
                case "del":
                    value = self.objects.pop(spec["obj"], None)
                    close = getattr(value, "close", None)
                    value = close() if callable(close) else None
                case kind:
                    raise ValueError(f"unknown sidecar call kind {kind!r}")
            pieces = _cut(value, outs, spec["name"])
        except (PathwaysError, RemoteError):
            raise
        except Exception:  # noqa: BLE001 - the user's code: its traceback goes back
            raise RemoteError(f"sidecar {spec['name']} on host {self._where}",
                              traceback.format_exc()) from None
        if spec["reply"]:
            pieces.append(value)
        if not pieces:
            return None
        return pieces[0] if len(pieces) == 1 else tuple(pieces)

    def _object(self, spec: dict):
        try:
            return self.objects[spec["obj"]]
        except KeyError:
            raise RemoteError(f"sidecar {spec['name']} on host {self._where}",
                              f"object #{spec['obj']} does not exist on this host (it was "
                              f"closed, or its constructor failed)") from None

    def _inputs(self, spec: dict, inputs: list) -> list[HostArray]:
        """The array arguments: this host's shards, from its chip workers."""
        if not inputs:
            return []
        got = boundary.get(list(inputs), timeout="stream",
                           what=f"the shards of sidecar {spec['name']}'s arguments")
        out = []
        for (shape, dtype, indexes), per_array in zip(spec["in_layout"], _transpose(got),
                                                       strict=True):
            shards = {}  # one per distinct block (a chip may hold another's copy)
            for index, block in zip(indexes, per_array, strict=True):
                shards.setdefault(tuple((s.start, s.stop) for s in index), (index, block))
            out.append(HostArray(tuple(shape), np.dtype(dtype), tuple(shards.values())))
        return out


def _transpose(got: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """Per chip [shard of each array] -> per array [shard from each chip]."""
    return [list(col) for col in zip(*got, strict=True)] if got else []


def _resolve(value, arrays: list[HostArray]):
    if isinstance(value, _Arg):
        return arrays[value.i]
    if isinstance(value, (list, tuple)) and any(isinstance(v, _Arg) for v in value):
        return type(value)(_resolve(v, arrays) for v in value)
    if isinstance(value, dict) and any(isinstance(v, _Arg) for v in value.values()):
        return {k: _resolve(v, arrays) for k, v in value.items()}
    return value


def _cut(value, outs: list[_Out], name: str) -> list[np.ndarray]:
    """The chip blocks of each output, from the host blocks the user returned."""
    if not outs:
        return []
    if len(outs) == 1:  # the array, or a 1-tuple of it
        one = isinstance(value, (list, tuple)) and len(value) == 1
        blocks = [value[0] if one else value]
    else:
        blocks = list(value) if isinstance(value, (list, tuple)) else None
    if blocks is None or len(blocks) != len(outs):
        raise ValueError(f"sidecar {name} must return {len(outs)} arrays (one per output), "
                         f"got {type(value).__name__}")
    pieces = []
    for i, (block, out) in enumerate(zip(blocks, outs, strict=True)):
        block = np.asarray(block)
        want = tuple(s.stop - s.start for s in out.box)
        if block.shape != want or block.dtype != np.dtype(out.dtype):
            raise ValueError(f"sidecar {name} returned {block.dtype}{list(block.shape)} for "
                             f"output {i}; this host's block is {out.dtype}{list(want)} "
                             f"(host.boxes[{i}] = {_fmt(out.box)} of {list(out.shape)})")
        for index in out.pieces:
            local = tuple(slice(s.start - b.start, s.stop - b.start)
                          for s, b in zip(index, out.box, strict=True))
            pieces.append(np.ascontiguousarray(block[local]))
    return pieces


def _fmt(box: tuple[slice, ...]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in box) + "]"
