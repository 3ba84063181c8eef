"""Checkpoints to storage: a pytree of ``RemoteArray``s as a standard Orbax checkpoint.

The bytes never pass through the client: ``save`` sends one ``Save`` command down
the slice's command stream and every chip worker writes its own shards with
Orbax (``StandardCheckpointer``, multi-process over the slice's JAX world, as a
multi-controller JAX program would); ``restore`` has every chip read only its
own shards. What lands on disk is a plain Orbax checkpoint: any JAX program can
read it with ``orbax.checkpoint``, and a new client on a new fleet can resume
from it (``restore``), with other shardings if it likes.

``path`` must be reachable by every host of the slice and by the client: a
shared filesystem, or a bucket (``gs://...``) on GKE. On the emulated fleet
every host is this machine.
"""

from __future__ import annotations

import os
from typing import Any

from pathways_ray.client.arrays import RemoteArray, spec_of
from pathways_ray.programs.sharding import MeshShape
from pathways_ray.transport.commands import Restore, Save

__all__ = ["restore", "save"]


def _local(path: str | os.PathLike) -> tuple[str, bool]:
    """``path`` as the workers should see it, and whether it is a local path."""
    path = os.fspath(path)
    if "://" in path:
        return path, False
    return os.path.abspath(path), True


def _key(entry) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _paths(tree, is_leaf=None) -> tuple[list[tuple[str, ...]], list, Any]:
    import jax

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [tuple(_key(k) for k in path) for path, _ in flat], [v for _, v in flat], treedef


def one_slice_arrays(tree, what: str) -> tuple[list[tuple[str, ...]], list[RemoteArray], str]:
    """The pytree paths, ``RemoteArray`` leaves and slice of ``tree``, which must be a
    non-empty pytree of ``RemoteArray``s on one slice (``what``: "a checkpoint is
    written", for the error)."""
    keys, arrays, _ = _paths(tree)
    if not arrays or not all(isinstance(a, RemoteArray) for a in arrays):
        kinds = sorted({type(a).__name__ for a in arrays})
        raise TypeError(f"tree must be a non-empty pytree of RemoteArrays, got leaves of "
                        f"type {kinds}; put host arrays on a slice first (client.device_put)")
    slices = sorted({a.slice for a in arrays})
    if len(slices) > 1:
        raise ValueError(f"tree holds arrays of slices {slices}; {what} by one slice: "
                         f"reshard the arrays onto one of them first")
    return keys, arrays, slices[0]


def save(path: str | os.PathLike, tree, *, timeout_s: float | None = None) -> int:
    """Write ``tree`` (a pytree of ``RemoteArray``s, all on one slice) as an Orbax
    checkpoint at ``path`` (a new directory). Returns the bytes of the arrays saved,
    once the checkpoint is committed on every chip (up to ``timeout_s``, default
    ``$PATHWAYS_RAY_FETCH_TIMEOUT_S``). Raises ``SliceLost`` if the slice is lost
    first; nothing is then committed at ``path``."""
    where, local = _local(path)
    keys, arrays, source = one_slice_arrays(tree, "a checkpoint is written")
    if local and os.path.exists(where):
        raise ValueError(f"path={os.fspath(path)!r} exists; a checkpoint goes to a new "
                         f"directory (one per step, e.g. {os.path.join(where, 'step_100')!r})")
    client = arrays[0]._client
    client._check(source)
    mesh: MeshShape = arrays[0].mesh
    status = RemoteArray(client, next(client._ids), source, (), "int32", mesh, ())
    client._queue.enqueue(source, Save(where, tuple(keys), tuple(a._id for a in arrays),
                                       status._id, mesh))
    written = int(client._fetch(status, timeout_s))
    if written != len(arrays):
        raise RuntimeError(f"the chips wrote {written} of {len(arrays)} arrays to {where!r}")
    return sum(a.nbytes for a in arrays)


def restore(client, path: str | os.PathLike, shardings, *, slice: str | int | None = None,
            timeout_s: float | None = None):
    """Read the Orbax checkpoint at ``path`` onto a slice's chips; returns the tree of
    ``RemoteArray``s (waits until every chip has read its shards).

    ``shardings`` is a pytree of ``NamedSharding`` over ``client.mesh(...)`` shaped like
    the saved tree (the result has its structure), or one ``NamedSharding`` for every
    array (the result is the saved tree, as nested dicts). Shapes and dtypes come from
    the checkpoint."""
    import jax
    import orbax.checkpoint as ocp

    where, local = _local(path)
    if local and not os.path.isdir(where):
        raise FileNotFoundError(f"path={os.fspath(path)!r}: no checkpoint there "
                                f"(written by pathways_ray.storage.checkpoint.save or Orbax)")
    with ocp.StandardCheckpointer() as ckpt:
        saved = ckpt.metadata(where).item_metadata.tree
    saved_keys, metas, _ = _paths(saved, is_leaf=lambda m: hasattr(m, "shape"))
    by_key = dict(zip(saved_keys, metas, strict=True))
    if hasattr(shardings, "spec"):
        keys, treedef = saved_keys, jax.tree.structure(saved, is_leaf=lambda m: hasattr(m, "shape"))
        leaves = [shardings] * len(keys)
    else:
        keys, leaves, treedef = _paths(shardings, is_leaf=lambda s: hasattr(s, "spec"))
        if sorted(keys) != sorted(saved_keys):
            ours, theirs = ({"/".join(k) for k in ks} for ks in (keys, saved_keys))
            raise ValueError(f"shardings do not match the arrays of the checkpoint at "
                             f"{where!r}: not in it {sorted(ours - theirs)}, missing "
                             f"{sorted(theirs - ours)}; give one sharding per saved array, "
                             f"or one NamedSharding for all")
    target = client.slice(slice)
    client._check(target.name)
    meshes, outs, specs = set(), [], []
    for key, sh in zip(keys, leaves, strict=True):
        meta = by_key[key]
        mesh, spec = spec_of(sh, len(meta.shape))
        if mesh.size != target.chips:
            raise ValueError(f"the mesh of {'/'.join(key)} has {mesh.size} devices; slice "
                             f"{target.name} has {target.chips} chips")
        meshes.add(mesh)
        specs.append(spec)
        outs.append(RemoteArray(client, next(client._ids), target.name, tuple(meta.shape),
                                meta.dtype, mesh, spec))
    if len(meshes) > 1:
        raise ValueError(f"shardings use {len(meshes)} different meshes; restore over one mesh "
                         f"per call")
    client._queue.enqueue(target.name, Restore(
        where, tuple(keys), tuple(o._id for o in outs), tuple(o.shape for o in outs),
        tuple(o.dtype.name for o in outs), tuple(specs), meshes.pop()))
    client.block_until_ready(outs, timeout_s)
    return jax.tree.unflatten(treedef, outs)
