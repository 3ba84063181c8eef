"""Checkpoints written by the hosts' sidecars: each host takes its own shards to storage.

``save`` hands every host's sidecar that host's shards of each array (through
the node's object store, never the client) and the sidecar writes them as
``.npy`` files under ``path`` (a directory every host sees: a shared volume, a
bucket mount). The client writes ``manifest.json`` last, once every host has
written: a checkpoint without one is incomplete and ``restore`` refuses it.
``restore`` has each host read what its chips need for the requested
shardings (any mesh of the same global shapes), so the bytes flow storage ->
host -> chips.

Where ``pathways_ray.storage.checkpoint`` (Orbax, written by the chip workers in the
command stream) is the interchange format, this one keeps the chips out of
storage I/O: their part ends when the host has the shards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from pathways_ray.chips.sidecar_host import HostArray

__all__ = ["restore", "save"]

MANIFEST = "manifest.json"


def _file(index: tuple[slice, ...]) -> str:
    return "_".join(f"{s.start}-{s.stop}" for s in index) + ".npy" if index else "scalar.npy"


def _index(name: str) -> tuple[slice, ...]:
    stem = name[:-len(".npy")]
    if stem == "scalar":
        return ()
    return tuple(slice(*map(int, part.split("-"))) for part in stem.split("_"))


def _keys(tree) -> tuple[list[str], list, object]:
    import jax
    from jax.tree_util import keystr

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = [keystr(p).strip("[]'\"").replace("']['", ".") or "value" for p, _ in flat]
    return keys, [v for _, v in flat], treedef


def write_shards(host, path: str, arrays: dict[str, HostArray]) -> int:
    """On a host: write its shards of each array; returns the bytes written."""
    written = 0
    for key, arr in arrays.items():
        folder = Path(path) / key
        folder.mkdir(parents=True, exist_ok=True)
        for index, block in arr.shards:
            tmp = folder / f".{_file(index)}.{host.worker_id}.tmp"
            with open(tmp, "wb") as f:
                np.save(f, block)
            os.replace(tmp, folder / _file(index))  # a reader never sees half a file
            written += block.nbytes
    return written


def read_shards(host, path: str, keys: list[str], dtypes: list[str]) -> tuple:
    """On a host: its block (``host.boxes``) of each array, from the shard files."""
    from pathways_ray.chips.executor import assemble

    out = []
    for key, box, dtype in zip(keys, host.boxes, dtypes, strict=True):
        folder = Path(path) / key
        pieces = []
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".npy") or name.startswith("."):
                continue
            index = _index(name)
            if all(max(a.start, b.start) < min(a.stop, b.stop)
                   for a, b in zip(index, box, strict=True)):
                pieces.append((index, np.load(folder / name, mmap_mode="r")))
        out.append(assemble(box, dtype, pieces))
    return tuple(out)


def save(client, tree, path: str | os.PathLike, *, timeout_s: float | None = None) -> int:
    """Write the ``RemoteArray``s of ``tree`` (all on one slice) to ``path``, each host its
    own shards; returns the bytes written."""
    keys, arrays, _ = _keys(tree)
    slices = {a.slice for a in arrays}
    if len(slices) != 1:
        raise ValueError(f"tree holds arrays on {sorted(slices)}; save the arrays of one "
                         f"slice (a replica) at a time")
    path = Path(path)
    if (path / MANIFEST).exists():
        raise FileExistsError(f"path={str(path)!r} holds a checkpoint already; pick a new "
                              f"directory per checkpoint")
    writer = client.sidecar(write_shards, slice=slices.pop())
    written = writer(str(path), dict(zip(keys, arrays, strict=True))).result(timeout_s)
    manifest = {k: {"shape": list(a.shape), "dtype": a.dtype.name}
                for k, a in zip(keys, arrays, strict=True)}
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path / MANIFEST)
    return sum(written)


def restore(client, path: str | os.PathLike, shardings, *, slice: str | int | None = None):
    """Read a checkpoint written by ``save`` onto ``slice``: ``shardings`` is a tree of
    ``NamedSharding`` like the one saved; returns the tree of ``RemoteArray``s."""
    import jax

    path = Path(path)
    if not (path / MANIFEST).exists():
        raise FileNotFoundError(f"path={str(path)!r} has no {MANIFEST}: not a checkpoint, or "
                                f"one whose save did not finish")
    manifest = json.loads((path / MANIFEST).read_text())
    keys, leaves, treedef = _keys(shardings)
    missing = [k for k in keys if k not in manifest]
    if missing:
        raise ValueError(f"the checkpoint at {str(path)!r} has no arrays {missing}; it holds "
                         f"{sorted(manifest)}")
    out = [jax.ShapeDtypeStruct(tuple(manifest[k]["shape"]), np.dtype(manifest[k]["dtype"]),
                                sharding=sh) for k, sh in zip(keys, leaves, strict=True)]
    reader = client.sidecar(read_shards, slice=slice).returning(out)
    arrays = reader(str(path), keys, [manifest[k]["dtype"] for k in keys])
    return jax.tree.unflatten(treedef, arrays)
