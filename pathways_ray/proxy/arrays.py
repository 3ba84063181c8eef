"""A session's arrays: what each IFRT array handle the client holds is, on the fleet.

An array is one of:
- on the chips: a ``RemoteArray`` of the session's ``Client``, on one slice or on
  several slices of one JAX world (the client's multislice group), laid out as the
  client's sharding says (``types.place``);
- still here: a one-device array made from host bytes (a shard of a ``device_put``,
  a scalar), put on the chips only when a program or a copy needs it there, so the
  shards of a sharded ``device_put`` reach the chips as one array, each chip its block;
- a shard of another array (``jax.Array.addressable_shards``): a view, read from the
  chip that holds it.

Arrays are immutable, so a host copy, once fetched, answers every later read. Every
move between slices is ``Client.reshard``: the chips copy the shards themselves.

A program's small results ride along: one read fetches the others too (MaxText reads a
step's metrics one scalar at a time). One-device arrays become one array on the chips.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from pathways_ray.client.arrays import Layout, RemoteArray
from pathways_ray.errors import PathwaysError
from pathways_ray.programs.hlo_sharding import replicated
from pathways_ray.programs.sharding import shard_slices
from pathways_ray.proxy.devices import ProxyDevice
from pathways_ray.proxy.errors import InvalidArgument, NotFound
from pathways_ray.proxy.types import Placed, ProxySharding, group_ranks, place

if TYPE_CHECKING:
    from pathways_ray.client.client import Client

__all__ = ["ArrayTable", "ProxyArray"]

logger = logging.getLogger(__name__)

# Results of one program read together: each at most RIDE_BYTES, RIDE_TOTAL_BYTES in all
# (the smallest first).
RIDE_BYTES = 64 * 1024
RIDE_TOTAL_BYTES = 256 * 1024


@dataclass(eq=False)
class ProxyArray:
    shape: tuple[int, ...]
    dtype: np.dtype
    placed: Placed
    device_ids: tuple[int, ...]  # the client's sharding devices, in its order
    op: object | None = None  # the client's tiling (OpSharding), None: one device/replicated
    remote: RemoteArray | None = None
    host: np.ndarray | None = None
    parent: ProxyArray | None = None  # a shard view: ``index`` of ``parent``
    index: tuple[slice, ...] | None = None
    cached: np.ndarray | None = field(default=None, repr=False)
    memory: str = "device"  # the chips' memory that holds it (a JAX memory kind)
    # A one-device array's copies on the chips of other placements (slices -> copy)
    copies: dict = field(default_factory=dict, repr=False)

    @property
    def single(self) -> bool:
        return self.placed.device is not None

    def blocks(self, devices: list[ProxyDevice], chips: list[int]) -> list[tuple[slice, ...]]:
        """The block of the array each of ``device_ids`` holds."""
        if self.single:
            return [tuple(slice(0, n) for n in self.shape)] * len(self.device_ids)
        by_rank = shard_slices(self.shape, self.placed.mesh, self.placed.spec)
        first = group_ranks(self.placed.slices, chips)
        return [by_rank[first[devices[d].slice_index] + devices[d].rank]
                for d in self.device_ids]


class ArrayTable:
    """Handle -> array (or the error that making it met, raised where it is used)."""

    def __init__(self, client: Client, devices: list[ProxyDevice], slices: list[dict],
                 joint: bool = False):
        self.client = client
        self.devices = devices
        self.slice_names = [s["name"] for s in slices]
        self.chips = [s["chips"] for s in slices]
        self.topologies = [str(s["topology"]) for s in slices]
        self.joint = joint  # the slices are one JAX world: an array may span several
        # A session's slice that was lost keeps its index (its devices, slice_index)
        # until a replacement of its shape joins the session in its place.
        self.lost: dict[int, BaseException] = {}
        self._used = set(self.slice_names)  # every name that backed an index
        self._arrays: dict[int, ProxyArray | BaseException] = {}
        self._deleted: set[int] = set()  # deleted (DeleteArray), not yet destructed
        # Fetches under way (array -> its future): the shards of one array, read at once
        # (jax reads a sharded array shard by shard), share one fetch of it.
        self._fetching: dict[ProxyArray, futures.Future] = {}
        self._fetching_lock = threading.Lock()
        # A program's small results: each -> its fellows (weak: freeing one frees it),
        # and those that rode along on another's read, until read (or freed).
        self._fellows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._rode: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._arrays)

    # ---- the table -------------------------------------------------------------------
    def set(self, handle: int, value: ProxyArray | BaseException) -> None:
        if handle in self._arrays or handle in self._deleted:
            raise InvalidArgument(f"array handle {handle} is in use already")
        self._arrays[handle] = value

    def get(self, handle: int) -> ProxyArray:
        value = self.entry(handle)
        if isinstance(value, BaseException):
            raise value
        return value

    def entry(self, handle: int) -> ProxyArray | BaseException:
        """The array, or the error that making it met."""
        value = self._arrays.get(handle)
        if value is None:
            if handle in self._deleted:
                raise NotFound(f"array handle {handle} was deleted")
            raise NotFound(f"unknown array handle {handle}: not an array of this session "
                           f"(destructed, or another session's)")
        return value

    def delete(self, handle: int) -> None:
        """Free the array's buffers now; the handle stays known as deleted until the
        client destructs it (``IsArrayDeleted``)."""
        self.entry(handle)
        del self._arrays[handle]
        self._deleted.add(handle)

    def is_deleted(self, handle: int) -> bool:
        if handle in self._deleted:
            return True
        self.entry(handle)  # NotFound for a handle this session never had
        return False

    def pop(self, handle: int) -> bool:
        """Forget a handle (``DestructArray``); whether it was the session's."""
        if handle in self._deleted:
            self._deleted.discard(handle)
            return True
        return self._arrays.pop(handle, None) is not None

    def clear(self) -> None:
        self._arrays.clear()
        self._deleted.clear()

    def place(self, sharding: ProxySharding, ndim: int) -> Placed:
        return place(sharding, ndim, self.devices, self.chips, joint=self.joint)

    def target(self, slices: tuple[int, ...]) -> str | list[str]:
        """What the client's calls take as ``slice=``: a slice's name, or a list of names
        (its multislice group of them). A lost slice is backed by its replacement once
        one has joined."""
        for i in slices:
            if i in self.lost:
                self._revive(i)
        names = [self.slice_names[s] for s in slices]
        return names[0] if len(names) == 1 else names

    def note_lost(self, e: BaseException) -> bool:
        """Slice ``e.slice`` (a ``SliceLost``) was lost: ask the controller for one like
        it, which it reserves in the background as soon as the cluster has one free.
        Whether this is news (the first report of that slice)."""
        name = getattr(e, "slice", None)
        if name not in self.slice_names:
            return False
        i = self.slice_names.index(name)
        if i in self.lost:
            return False
        self.lost[i] = e
        logger.warning("slice %s (index %d) was lost; a replacement is asked for", name, i)
        try:
            self.client.request_slices(len(self.lost))
        except (ValueError, PathwaysError) as refused:  # a lease cannot grow
            logger.info("no replacement for slice %s: %s", name, refused)
        return True

    def _revive(self, i: int) -> bool:
        """Back lost slice ``i`` by a replacement of its shape that joined the client."""
        try:
            self.client.refresh_slices()
        except PathwaysError:
            return False
        for s in self.client.slices:
            if s.name not in self._used and str(s.topology) == self.topologies[i]:
                logger.warning("slice %s takes the place of lost slice %s (index %d)",
                               s.name, self.slice_names[i], i)
                self.slice_names[i] = s.name
                self._used.add(s.name)
                del self.lost[i]
                return True
        return False

    def name(self, slices: tuple[int, ...]) -> str:
        """The client's placement name of ``slices`` (a slice, or its group of them)."""
        return self.client.slice(self.target(slices)).name

    def describe(self, slices: tuple[int, ...]) -> str:
        return (f"slice {self.slice_names[slices[0]]}" if len(slices) == 1 else
                "slices " + ", ".join(self.slice_names[s] for s in slices))

    # ---- making arrays ---------------------------------------------------------------
    def from_host(self, data: np.ndarray, sharding: ProxySharding) -> ProxyArray:
        placed = self.place(sharding, data.ndim)
        arr = ProxyArray(tuple(data.shape), data.dtype, placed, sharding.device_ids,
                         sharding.op, memory=sharding.memory_kind)
        if placed.device is not None:
            arr.host = data  # to the chips when used there
        else:
            arr.remote = self._put(data, placed, arr.memory)
        return arr

    def _put(self, data: np.ndarray, placed: Placed, memory: str) -> RemoteArray:
        return self.client.device_put(data, Layout(placed.mesh, placed.spec, memory),
                                      slice=self.target(placed.slices))

    def assemble(self, parts: list[ProxyArray], shape: tuple[int, ...], dtype: np.dtype,
                 sharding: ProxySharding) -> ProxyArray:
        """One array of ``parts`` (the shard on each of ``sharding``'s devices)."""
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"an array of shape {list(shape)}: a dimension is negative")
        placed = self.place(sharding, len(shape))
        if len(parts) != len(sharding.device_ids):
            raise InvalidArgument(f"{len(parts)} single-device arrays for a sharding over "
                                  f"{len(sharding.device_ids)} devices")
        arr = ProxyArray(tuple(shape), np.dtype(dtype), placed, sharding.device_ids,
                         sharding.op, memory=sharding.memory_kind)
        blocks = arr.blocks(self.devices, self.chips)
        for i, (index, part) in enumerate(zip(blocks, parts, strict=True)):
            want = tuple(s.stop - s.start for s in index)
            if tuple(part.shape) != want or part.dtype != arr.dtype:
                raise InvalidArgument(
                    f"single-device array {i} is {part.dtype} {list(part.shape)}; the "
                    f"{arr.dtype} {list(shape)} array's shard there is {list(want)}")
        parents = {id(p.parent) for p in parts}
        first = parts[0].parent
        if (len(parents) == 1 and first is not None and first.placed == placed
                and first.device_ids == sharding.device_ids and first.shape == arr.shape
                and first.memory == arr.memory):
            arr.remote, arr.host = first.remote, first.host  # taken apart, put back
            return arr
        if placed.device is not None:
            if parts[0].memory == arr.memory:
                arr.remote, arr.host = parts[0].remote, parts[0].host
            if arr.remote is None and arr.host is None:
                arr.host = self.to_host(parts[0])
            return arr
        if len(placed.slices) == 1 and arr.memory == "device" and all(
                p.remote is not None and p.single and p.memory == arr.memory
                and p.placed.slices == placed.slices for p in parts) and len(
                {p.remote.mesh for p in parts}) == 1:  # (one program takes them all)
            from pathways_ray.proxy.programs import assemble_on_chips  # (it imports us)
            arr.remote = assemble_on_chips(self, [p.remote for p in parts], blocks, placed, arr)
            return arr
        full = np.empty(shape, dtype)
        for index, part in zip(blocks, parts, strict=True):
            full[index] = self.to_host(part)
        arr.remote = self._put(full, placed, arr.memory)
        return arr

    def disassemble(self, arr: ProxyArray) -> list[ProxyArray]:
        """One single-device array per device of ``arr``, in its sharding's order."""
        if arr.single:  # itself (a shard view stays a view)
            return [replace(arr)]
        out = []
        for d, index in zip(arr.device_ids, arr.blocks(self.devices, self.chips), strict=True):
            one = ProxyArray(tuple(s.stop - s.start for s in index), arr.dtype,
                             self._one(len(index), d), (d,), memory=arr.memory)
            self._share(arr, one, index)
            out.append(one)
        return out

    def _share(self, arr: ProxyArray, one: ProxyArray, index: tuple[slice, ...]) -> None:
        """One device's part of ``arr``: ``arr`` itself where it is replicated on the same
        slice; else a view of it, read from the chip that holds it when needed."""
        if self._replicated(arr) and arr.placed.slices == one.placed.slices:
            one.remote, one.host, one.cached = arr.remote, arr.host, arr.cached
        else:
            one.parent, one.index = arr, index

    def fully_replicated_shard(self, arr: ProxyArray) -> ProxyArray:
        if arr.single:
            return replace(arr)
        if not self._replicated(arr):
            raise InvalidArgument("fully_replicated_shard of an array that is not replicated")
        one = ProxyArray(arr.shape, arr.dtype, self._one(len(arr.shape), arr.device_ids[0]),
                         arr.device_ids[:1], memory=arr.memory)
        self._share(arr, one, tuple(slice(0, n) for n in arr.shape))
        return one

    def _one(self, ndim: int, device: int) -> Placed:
        """A one-device array: on every chip of its device's slice once on the chips."""
        s = self.devices[device].slice_index
        return Placed((s,), *replicated(self.chips[s], ndim), device=device)

    @staticmethod
    def _replicated(arr: ProxyArray) -> bool:
        return all(not axes for axes in arr.placed.spec)

    # ---- reading and moving ----------------------------------------------------------
    def to_host(self, arr: ProxyArray, timeout_s: float | None = None) -> np.ndarray:
        if arr.cached is not None:
            return arr.cached
        if arr.host is not None:
            return arr.host
        if arr.parent is not None:
            return self.to_host(arr.parent, timeout_s)[arr.index]
        with self._fetching_lock:
            pending = self._fetching.get(arr)
            if pending is None:
                mine = self._fetching[arr] = futures.Future()
        if pending is not None:  # another thread fetches it, within its own timeout
            return pending.result()
        try:
            arr.cached = self._fetch(arr.remote, timeout_s)
            mine.set_result(arr.cached)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._fetching_lock:
                del self._fetching[arr]
        return arr.cached

    def results(self, remotes: list[RemoteArray]) -> None:
        """Note one program's results: its small ones are read together."""
        total, group = 0, []
        for r in sorted((r for r in remotes if r.nbytes <= RIDE_BYTES), key=lambda r: r.nbytes):
            if (total := total + r.nbytes) > RIDE_TOTAL_BYTES:
                break
            group.append(weakref.ref(r))
        with self._fetching_lock:  # (a lone one has no fellows)
            self._fellows.update((ref(), group) for ref in group if len(group) > 1)

    def _fetch(self, remote: RemoteArray, timeout_s: float | None) -> np.ndarray:
        """``remote``'s bytes, and with them its unread fellows' (one round trip)."""
        with self._fetching_lock:
            if (rode := self._rode.get(remote)) is not None:
                return rode
            group = self._fellows.pop(remote, ())
            fellows = [r for r in (ref() for ref in group)
                       if r is not None and r is not remote and self._fellows.pop(r, None)]
        if not fellows:
            return remote.fetch(timeout_s)
        # (A fellow freed or donated meanwhile stays behind: it can no longer be read.)
        values = self.client.fetch_all([remote, *fellows], timeout_s, missing_ok=True)
        with self._fetching_lock:
            for r, v in zip(fellows, values[1:], strict=True):
                if v is not None:
                    self._rode[r] = v
        return remote.fetch(timeout_s) if values[0] is None else values[0]  # (its error)

    def on_chips(self, arr: ProxyArray, slices: tuple[int, ...]) -> RemoteArray:
        """``arr`` on the chips of ``slices``, as a program there reads it: where it lives,
        or (a one-device array) a copy on every chip of them."""
        if arr.placed.slices == slices and arr.remote is not None:
            return arr.remote
        if not arr.single or not set(arr.placed.slices) <= set(slices):
            raise InvalidArgument(
                f"an argument is on {self.describe(arr.placed.slices)}, the program runs on "
                f"{self.describe(slices)}: device_put it there first")
        if arr.placed.slices == slices:
            target = arr  # its own slice: the copy is the array's own
        elif slices in arr.copies:
            return arr.copies[slices]
        else:
            target = None
        logger.debug("putting a %s %s array on %s", arr.dtype, arr.shape, self.describe(slices))
        mesh, spec = replicated(sum(self.chips[s] for s in slices), len(arr.shape))
        remote = self.client.device_put(self.to_host(arr), Layout(mesh, spec, arr.memory),
                                        slice=self.target(slices))
        if target is None:
            arr.copies[slices] = remote
        else:
            arr.remote = remote
        return remote

    def copy(self, arr: ProxyArray, device_ids: tuple[int, ...], memory: str = "") -> ProxyArray:
        """``arr`` with the same sharding on other devices (another slice: chip to chip)
        or in another of their memories (``memory``; "": the same)."""
        if len(device_ids) != len(arr.device_ids):
            raise InvalidArgument(f"copying an array on {len(arr.device_ids)} devices to "
                                  f"{len(device_ids)} devices")
        return self.reshard(arr, ProxySharding(tuple(device_ids), arr.op, memory or arr.memory))

    def reshard(self, arr: ProxyArray, sharding: ProxySharding) -> ProxyArray:
        placed = self.place(sharding, len(arr.shape))
        out = ProxyArray(arr.shape, arr.dtype, placed, sharding.device_ids, sharding.op,
                         memory=sharding.memory_kind)
        if arr.remote is not None and arr.memory == out.memory and (placed == arr.placed or (
                arr.single and placed.device is not None and placed.slices == arr.placed.slices)):
            out.remote = arr.remote  # (a one-device array is on every chip of its slice)
        elif arr.remote is None or arr.parent is not None or placed.device is not None:
            data = self.to_host(arr)  # still here (or one device): from the proxy
            if placed.device is not None:
                out.host = data
            else:
                out.remote = self._put(data, placed, out.memory)
        else:
            out.remote = self.client.reshard(
                arr.remote, Layout(placed.mesh, placed.spec, out.memory),
                slice=self.target(placed.slices))
        return out

    def ready(self, arrays: list[ProxyArray], timeout_s: float | None = None) -> None:
        remote = [a.remote for a in arrays if a.remote is not None and a.cached is None]
        remote += [a.parent.remote for a in arrays if a.parent is not None
                   and a.parent.remote is not None]
        if remote:
            self.client.block_until_ready(remote, timeout_s)
