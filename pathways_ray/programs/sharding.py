"""Which part of an array each chip of a slice holds. Pure: numpy only.

The client never holds a slice's devices, so it cannot ask JAX's
``NamedSharding.devices_indices_map``; this computes the same map from the
mesh shape, its axis names and a PartitionSpec. Devices are numbered in
row-major order over the mesh, which is how chip workers build their mesh from
``jax.devices()`` (rank order).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod

__all__ = ["HostBlocks", "MeshShape", "PullPlan", "TransferPacking", "host_blocks",
           "normalize_spec", "pack_transfer", "pull_transfer", "shard_slices",
           "transfer_plan", "unique_shards"]

Spec = tuple[tuple[str, ...], ...]  # per array dim: the mesh axes it is split over


@dataclass(frozen=True)
class MeshShape:
    """Axis names and sizes of a mesh over the chips of one slice.

    ``devices``: the chips (slice ranks) in the mesh's row-major order when that is
    not rank order (a layout JAX chose, met through the IFRT proxy); None is rank
    order, as every mesh made here is."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    devices: tuple[int, ...] | None = None

    def __post_init__(self):
        if len(self.axis_names) != len(self.axis_sizes):
            raise ValueError(
                f"mesh has {len(self.axis_names)} axis names {self.axis_names} but "
                f"{len(self.axis_sizes)} sizes {self.axis_sizes}"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names {self.axis_names} repeat a name")
        if self.devices is not None and sorted(self.devices) != list(range(self.size)):
            raise ValueError(f"mesh devices {self.devices} must order the ranks "
                             f"0..{self.size - 1}, each once")

    @property
    def size(self) -> int:
        return prod(self.axis_sizes)

    def coords(self) -> list[dict[str, int]]:
        """Mesh coordinates of each device, in row-major (rank) order."""
        return [dict(zip(self.axis_names, c, strict=True))
                for c in itertools.product(*(range(n) for n in self.axis_sizes))]


def normalize_spec(spec: Sequence, ndim: int, mesh: MeshShape) -> Spec:
    """``P('data', None)`` / ``('data', ('x', 'y'))`` -> per-dim tuples of axis names.

    Checks that every axis exists in the mesh and is used at most once.
    """
    entries = list(spec)
    if len(entries) > ndim:
        raise ValueError(f"sharding spec {tuple(spec)} has {len(entries)} entries for a "
                         f"{ndim}-dimensional array")
    entries += [None] * (ndim - len(entries))
    out, used = [], set()
    for entry in entries:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(f"sharding spec {tuple(spec)} names axis {a!r}; the mesh "
                                 f"has {mesh.axis_names}")
            if a in used:
                raise ValueError(f"sharding spec {tuple(spec)} uses mesh axis {a!r} twice")
            used.add(a)
        out.append(axes)
    return tuple(out)


def shard_slices(shape: Sequence[int], mesh: MeshShape, spec: Spec) -> list[tuple[slice, ...]]:
    """The index each device (rank order, whatever the mesh's order) holds of an array
    of ``shape``."""
    return list(_shard_slices(tuple(shape), mesh, tuple(tuple(axes) for axes in spec)))


@lru_cache(maxsize=4096)  # every put and transfer asks again for the same few layouts
def _shard_slices(shape: tuple[int, ...], mesh: MeshShape, spec: Spec) -> tuple:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    for dim, (n, axes) in enumerate(zip(shape, spec, strict=True)):
        parts = prod(sizes[a] for a in axes)
        if n % parts:
            raise ValueError(f"dimension {dim} of size {n} does not split evenly over mesh "
                             f"axes {axes} ({parts} parts)")
    out = []
    for coord in mesh.coords():
        index = []
        for n, axes in zip(shape, spec, strict=True):
            parts, block = 1, 0
            for a in axes:  # major to minor, as XLA lays out multi-axis dims
                block = block * sizes[a] + coord[a]
                parts *= sizes[a]
            step = n // parts
            index.append(slice(block * step, (block + 1) * step))
        out.append(tuple(index))
    if mesh.devices is not None:  # mesh position -> the rank there
        ranked = [None] * len(out)
        for position, rank in enumerate(mesh.devices):
            ranked[rank] = out[position]
        out = ranked
    return tuple(out)


def unique_shards(indices: list[tuple[slice, ...]]) -> list[int]:
    """For each device, the first device holding the same index (its replica 0)."""
    first: dict[tuple, int] = {}
    out = []
    for rank, idx in enumerate(indices):
        key = tuple((s.start, s.stop) for s in idx)
        out.append(first.setdefault(key, rank))
    return out


def transfer_plan(shape: Sequence[int], src_mesh: MeshShape, src_spec: Spec,
                  dst_mesh: MeshShape, dst_spec: Spec):
    """How to copy an array between two shardings, shard by shard.

    Returns ``(src_index, sources, needs)``: every source rank's block, the source
    ranks that hold a distinct block (one copy each is enough), and for every
    destination rank the ones of those whose blocks overlap its own.
    """
    src_index = shard_slices(shape, src_mesh, src_spec)
    sources = sorted(set(unique_shards(src_index)))
    needs = [[r for r in sources
              if all(a.start < b.stop and b.start < a.stop
                     for a, b in zip(index, src_index[r], strict=True))]
             for index in shard_slices(shape, dst_mesh, dst_spec)]
    return src_index, sources, needs


@dataclass(frozen=True)
class TransferPacking:
    """Who sends what in a copy of several arrays between slices (``pack_transfer``).

    ``sends[r]`` lists source rank ``r``'s packets, each the array positions it puts
    in one object for one destination host; ``pieces[i][d]`` lists, for array ``i``
    and destination rank ``d``, ``(source rank, packet, position in it, the source
    block)`` of every block ``d`` assembles its own from.
    """

    sends: dict[int, list[list[int]]]
    pieces: list[list[list[tuple[int, int, int, tuple[slice, ...]]]]]


def pack_transfer(arrays: Sequence[tuple[Sequence[int], int, MeshShape, Spec, MeshShape, Spec]],
                  dst_hosts: Sequence) -> TransferPacking:
    """Plan a copy of several arrays ``(shape, itemsize, src mesh, src spec, dst mesh,
    dst spec)`` to a slice whose rank ``d`` runs on host ``dst_hosts[d]``.

    Every block a destination host needs crosses once, in one object per (source
    chip, destination host) pair for all the arrays: per-object costs (a put, a
    pull, a lookup) are paid by a handful of objects, not by every shard of every
    array. A block held by several source chips (replicated along a mesh axis) is
    sent by the one with the fewest bytes to send so far, so replicas share the work.
    """
    load: dict[int, int] = {}
    packets: dict[tuple[int, object], dict[int, int]] = {}  # (rank, host) -> array -> pos
    pieces = []
    for i, (shape, itemsize, src_mesh, src_spec, dst_mesh, dst_spec) in enumerate(arrays):
        src_index, _, needs = transfer_plan(shape, src_mesh, src_spec, dst_mesh, dst_spec)
        holders: dict[tuple, list[int]] = {}
        for rank, idx in enumerate(src_index):
            holders.setdefault(tuple((b.start, b.stop) for b in idx), []).append(rank)
        chosen: dict[tuple[int, object], int] = {}  # (first holder, host) -> sender
        per_dst = []
        for d, firsts in enumerate(needs):
            host, mine = dst_hosts[d], []
            for first in firsts:
                sender = chosen.get((first, host))
                if sender is None:
                    key = tuple((b.start, b.stop) for b in src_index[first])
                    sender = min(holders[key], key=lambda r: (load.get(r, 0), r))
                    load[sender] = load.get(sender, 0) + itemsize * prod(
                        b.stop - b.start for b in src_index[first])
                    chosen[first, host] = sender
                packet = packets.setdefault((sender, host), {})
                pos = packet.setdefault(i, len(packet))
                mine.append((sender, host, pos, src_index[sender]))
            per_dst.append(mine)
        pieces.append(per_dst)
    number: dict[tuple[int, object], int] = {}
    sends: dict[int, list[list[int]]] = {}
    for (rank, host), packet in packets.items():
        number[rank, host] = len(sends.setdefault(rank, []))
        sends[rank].append(list(packet))
    return TransferPacking(sends, [[[(r, number[r, h], pos, blk) for r, h, pos, blk in mine]
                                    for mine in per_dst] for per_dst in pieces])


@dataclass(frozen=True)
class PullPlan:
    """Who pulls what in a copy of several arrays between slices, chip from chip
    (``pull_transfer``).

    ``sends[r][d]`` lists what destination rank ``d`` pulls from source rank ``r``,
    in one pull: ``(array position, the piece's global block, the piece relative to
    r's shard, or None for all of it)``. ``pieces[i][d]`` lists, for array ``i`` and
    destination rank ``d``, ``(source rank, position in that pull, the piece's global
    block)`` of the pieces ``d`` assembles its block from.
    """

    sends: dict[int, dict[int, list[tuple[int, tuple[slice, ...], tuple[slice, ...] | None]]]]
    pieces: list[list[list[tuple[int, int, tuple[slice, ...]]]]]


@lru_cache(maxsize=64)  # a weight sync plans the same transfer every iteration
def pull_transfer(arrays: tuple[tuple[tuple[int, ...], int, MeshShape, Spec, MeshShape, Spec],
                                ...]) -> PullPlan:
    """Plan a copy of several arrays ``(shape, itemsize, src mesh, src spec, dst mesh,
    dst spec)`` to another slice as pulls: each destination chip pulls, from each
    source chip it needs, exactly the parts of its own blocks that chip holds, all the
    arrays in one pull. Nothing it does not keep crosses; a piece that is a whole
    destination block lands as that block. A part held by several source chips
    (replicated along a mesh axis) comes from the one with the fewest bytes to send
    so far, so replicas share the work. ``arrays`` is a tuple (the plan is cached;
    read it, never change it).
    """
    load: dict[int, int] = {}
    sends: dict[int, dict[int, list]] = {}
    pieces = []
    for i, (shape, itemsize, src_mesh, src_spec, dst_mesh, dst_spec) in enumerate(arrays):
        src_index, _, needs = transfer_plan(shape, src_mesh, src_spec, dst_mesh, dst_spec)
        dst_index = shard_slices(shape, dst_mesh, dst_spec)
        holders: dict[tuple, list[int]] = {}
        for rank, idx in enumerate(src_index):
            holders.setdefault(tuple((b.start, b.stop) for b in idx), []).append(rank)
        per_dst = []
        for d, firsts in enumerate(needs):
            mine = []
            for first in firsts:
                block = src_index[first]
                part = tuple(slice(max(a.start, b.start), min(a.stop, b.stop))
                             for a, b in zip(dst_index[d], block, strict=True))
                sender = min(holders[tuple((b.start, b.stop) for b in block)],
                             key=lambda r: (load.get(r, 0), r))
                load[sender] = load.get(sender, 0) + itemsize * prod(
                    p.stop - p.start for p in part)
                rel = None if part == block else tuple(
                    slice(p.start - b.start, p.stop - b.start)
                    for p, b in zip(part, block, strict=True))
                pull = sends.setdefault(sender, {}).setdefault(d, [])
                mine.append((sender, len(pull), part))
                pull.append((i, part, rel))
            per_dst.append(mine)
        pieces.append(per_dst)
    return PullPlan(sends, pieces)


def spread_shards(arrays: Sequence[tuple[Sequence[int], int, MeshShape, Spec]],
                  ) -> dict[int, list[tuple[int, tuple[slice, ...]]]]:
    """Which chip sends which block when every block of several arrays is to be copied
    off a slice once (a host-memory snapshot).

    ``arrays`` are ``(shape, itemsize, mesh, spec)``. Returns, per rank, the
    ``(array position, block)`` pairs it sends. Every distinct block goes once, from
    the holder with the fewest bytes so far, so replicated arrays are spread over
    the chips instead of all coming from rank 0.
    """
    load: dict[int, int] = {}
    out: dict[int, list[tuple[int, tuple[slice, ...]]]] = {}
    for pos, (shape, itemsize, mesh, spec) in enumerate(arrays):
        index = shard_slices(shape, mesh, spec)
        holders: dict[tuple, list[int]] = {}
        for rank, idx in enumerate(index):
            holders.setdefault(tuple((s.start, s.stop) for s in idx), []).append(rank)
        for ranks in holders.values():
            rank = min(ranks, key=lambda r: (load.get(r, 0), r))
            block = index[rank]
            nbytes = itemsize * prod(s.stop - s.start for s in block)
            load[rank] = load.get(rank, 0) + nbytes
            out.setdefault(rank, []).append((pos, block))
    return out


@dataclass(frozen=True)
class HostBlocks:
    """One host's part of an array: the bounding box of its chips' shards, its
    distinct chip blocks, and which of them each of its chips holds."""

    box: tuple[slice, ...]
    pieces: tuple[tuple[slice, ...], ...]
    chip_piece: dict[int, int]  # rank -> position in ``pieces``


def host_blocks(shape: Sequence[int], mesh: MeshShape, spec: Spec,
                hosts: Sequence[Sequence[int]]) -> list[HostBlocks]:
    """Per host (the ranks of its chips), what of the array it holds (``HostBlocks``).
    A host makes its box and cuts it into its pieces: a replicated array is one piece
    per host, a batch split over the chips of a host one piece per chip."""
    index = shard_slices(shape, mesh, spec)
    out = []
    for ranks in hosts:
        pieces: list[tuple[slice, ...]] = []
        chip_piece = {}
        for r in ranks:
            if index[r] not in pieces:
                pieces.append(index[r])
            chip_piece[r] = pieces.index(index[r])
        box = tuple(slice(min(p[d].start for p in pieces), max(p[d].stop for p in pieces))
                    for d in range(len(shape)))
        out.append(HostBlocks(box, tuple(pieces), chip_piece))
    return out
