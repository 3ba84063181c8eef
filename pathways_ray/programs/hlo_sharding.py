"""XLA's shardings (``OpSharding``: a tile assignment over a device list) as
pathways-ray layouts: a ``MeshShape`` over a slice's chips and a spec. Pure: numpy.

JAX sends and the compiler returns shardings as ``OpSharding``; the chips and the
client keep arrays as a mesh and a spec. Any tile assignment is one: a mesh axis
per tiled dimension (``d0``, ``d1``, ...) and one per replicated subgroup (``r0``),
its devices the assignment's own, in its order. Works on jaxlib's ``OpSharding``
and on the protobuf message alike (the same field names).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import numpy as np

from pathways_ray.programs.sharding import MeshShape, Spec

__all__ = ["REPLICATED", "layout_of", "replicated", "sharding_kind"]

# OpSharding.Type
REPLICATED, MAXIMAL, TUPLE, OTHER, MANUAL, UNKNOWN, UNREDUCED = range(7)
_KINDS = ("REPLICATED", "MAXIMAL", "TUPLE", "OTHER", "MANUAL", "UNKNOWN", "UNREDUCED")


def sharding_kind(op) -> int:
    return int(getattr(op.type, "value", op.type))


def replicated(chips: int, ndim: int) -> tuple[MeshShape, Spec]:
    """Every chip holds all of it."""
    return MeshShape(("chips",), (chips,)), ((),) * ndim


def _positions(op) -> np.ndarray:
    """The tile assignment: for each tile, the position of its device in the list."""
    dims = [int(d) for d in op.tile_assignment_dimensions]
    if len(op.iota_reshape_dims):
        return (np.arange(prod(dims)).reshape([int(d) for d in op.iota_reshape_dims])
                .transpose([int(p) for p in op.iota_transpose_perm]).reshape(dims))
    return np.asarray(list(op.tile_assignment_devices), dtype=np.int64).reshape(dims)


def layout_of(op, device_ranks: Sequence[int], ndim: int, chips: int) -> tuple[MeshShape, Spec]:
    """The layout of an ``ndim``-dimensional array with sharding ``op`` over devices
    whose slice ranks are ``device_ranks`` (position in the sharding's device list ->
    rank), on a slice of ``chips`` chips. ``ValueError`` naming what is not one: a
    manual or single-device sharding, or one over only some of the slice's chips."""
    kind = sharding_kind(op)
    if kind == REPLICATED:
        return replicated(chips, ndim)
    if kind != OTHER:
        raise ValueError(f"an OpSharding of type {_KINDS[kind] if kind < 7 else kind} is not "
                         f"a layout over a slice's chips (tiled or replicated ones are)")
    dims = [int(d) for d in op.tile_assignment_dimensions]
    subgroups = [int(getattr(t, "value", t)) for t in op.last_tile_dims]
    if any(t != REPLICATED for t in subgroups):
        raise ValueError(f"an OpSharding with subgroups {subgroups} (manual) is not a layout "
                         f"over a slice's chips")
    extra = 1 if op.replicate_on_last_tile_dim else len(subgroups)
    if len(dims) - extra != ndim:
        raise ValueError(f"an OpSharding of {len(dims) - extra} tiled dimensions for a "
                         f"{ndim}-dimensional array")
    ranks = np.asarray(device_ranks, dtype=np.int64)[_positions(op)]
    order = tuple(int(r) for r in ranks.flat)
    if sorted(order) != list(range(chips)):
        raise ValueError(f"the sharding places the array on chips {sorted(set(order))} of a "
                         f"slice of {chips}: an array on a slice is on all of its chips, or "
                         f"on one device")
    names = tuple(f"d{i}" for i in range(ndim)) + tuple(f"r{j}" for j in range(extra))
    mesh = MeshShape(names, tuple(dims), None if order == tuple(range(chips)) else order)
    return mesh, tuple((f"d{i}",) if dims[i] > 1 else () for i in range(ndim))
