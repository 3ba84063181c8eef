"""Host-memory snapshots: the training state copied off its slice, kept in RAM.

``take(tree, step)`` copies a pytree of ``RemoteArray``s (all on one slice) into
the host memory of a ``SnapshotKeeper`` actor that lives beside the client, on
its node: off every TPU host, so losing any slice loses no snapshot. It returns
at once; the copy runs while the next steps do. Every distinct block goes once,
spread over the slice's chips (``sharding.spread_shards``); each chip hands its
share over as one object and the keeper pulls them and assembles whole arrays.
The keeper keeps the latest complete snapshot; one that a lost slice cut short
is dropped and the one before stays.

``restore(client, shardings, slice=)`` puts the latest snapshot onto a slice.
A data parallel run needs it only when no slice holding a replica is left (a
survivor's replica is the first source; ``DataParallelTrainer`` does both).

Pathways keeps its elastic snapshots in the TPU hosts' own memory
(pathwaysutils' ``maybe_snapshot``), lost with the host; a keeper off the slice
survives the host. On GKE it is the Ray head pod's memory; size it for the
state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways_ray.programs.sharding import spread_shards

__all__ = ["Snapshot", "SnapshotKeeper", "restore", "take"]


class SnapshotKeeper:
    """Holds the latest complete snapshot: ``(step, keys, arrays)``, whole numpy arrays.

    A Ray actor (``ray.remote(num_cpus=0, max_concurrency=4)``) on the client's node;
    ``take`` calls run in threads, so a query is never stuck behind a copy."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: tuple[int, list, list[np.ndarray]] | None = None
        self.taken = self.dropped = 0

    def take(self, step: int, layout: list, parts: dict, refs: dict,
             timeout_s: float) -> tuple[int, str]:
        """Pull every chip's share (``refs``: rank -> ref of a list of blocks; ``parts``:
        rank -> ``(array position, block)`` of each) into whole arrays shaped as in
        ``layout`` (``(key, shape, dtype)``). Returns ``(step, "")``, or ``(-1, why)``
        if a share never came (its chip died): the previous snapshot stays."""
        import ray

        try:
            shares = ray.get([refs[r] for r in parts], timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - the slice died under the copy: drop it
            with self._lock:
                self.dropped += 1
            return -1, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        arrays = [np.empty(shape, dtype) for _, shape, dtype in layout]
        for rank, share in zip(parts, shares, strict=True):
            for (pos, block), value in zip(parts[rank], share, strict=True):
                arrays[pos][block] = value
        with self._lock:
            if self._latest is None or step >= self._latest[0]:
                self._latest = (step, [key for key, _, _ in layout], arrays)
            self.taken += 1
        return step, ""

    def latest(self) -> tuple[int, list, list[np.ndarray]] | None:
        with self._lock:
            return self._latest

    def info(self) -> dict:
        with self._lock:
            step = None if self._latest is None else self._latest[0]
            nbytes = 0 if self._latest is None else sum(a.nbytes for a in self._latest[2])
            return {"step": step, "bytes": nbytes, "taken": self.taken,
                    "dropped": self.dropped}


def _keeper(client):
    """The client's keeper, started on first use on the client's node; stopped with
    the client (``Client.close``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if client._keeper is None:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)
        client._keeper = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0,
                                    scheduling_strategy=here)(SnapshotKeeper).remote()
    return client._keeper


@dataclass
class Snapshot:
    """A snapshot on its way to the keeper. ``done()`` does not wait; ``wait()`` does and
    returns whether it completed (False: its slice was lost first; the previous one
    stays). Holds the arrays until the copy is done, so nothing frees them under it."""

    step: int
    _ref: Any
    _arrays: list | None

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        if ready:
            self._arrays = None
        return bool(ready)

    def wait(self, timeout_s: float | None = None) -> bool:
        from pathways_ray import boundary

        step, _ = boundary.get(self._ref, timeout="fetch" if timeout_s is None else timeout_s,
                               what=f"the snapshot of step {self.step}")
        self._arrays = None
        return step >= 0


def take(tree, step: int) -> Snapshot:
    """Start copying ``tree`` (a pytree of ``RemoteArray``s on one slice) into the
    keeper's host memory as the snapshot of ``step``; returns at once."""
    from pathways_ray.storage.checkpoint import one_slice_arrays

    keys, arrays, where = one_slice_arrays(tree, "a snapshot is taken")
    client = arrays[0]._client
    parts = spread_shards([(a.shape, a.dtype.itemsize, a.mesh, a.spec) for a in arrays])
    plan = {r: [arrays[pos]._id for pos, _ in blocks] for r, blocks in parts.items()}
    client._sync(where)
    refs = client._call("snapshot_refs", where, plan, where=where)
    layout = [(key, a.shape, a.dtype.name) for key, a in zip(keys, arrays, strict=True)]
    from pathways_ray import config

    ref = _keeper(client).take.remote(step, layout, parts, refs, config.timeout_s("fetch"))
    return Snapshot(step, ref, arrays)


def latest_step(client) -> int | None:
    """The step of the latest complete snapshot, None if there is none."""
    from pathways_ray import boundary

    if client._keeper is None:
        return None
    return boundary.get(client._keeper.info.remote(), timeout="control",
                        what="the snapshot keeper")["step"]


def restore(client, shardings, *, slice: str | int | None = None,
            timeout_s: float | None = None) -> tuple[int, Any]:
    """Put the latest complete snapshot onto a slice's chips; returns ``(step, tree)``.

    ``shardings`` is a pytree of ``NamedSharding`` shaped like the snapshot's tree (the
    result has its structure) or one ``NamedSharding`` for every array. Raises
    ``LookupError`` if no snapshot is complete yet."""
    import jax

    from pathways_ray import boundary
    from pathways_ray.storage.checkpoint import _paths

    got = None
    if client._keeper is not None:
        got = boundary.get(client._keeper.latest.remote(),
                           timeout="fetch" if timeout_s is None else timeout_s,
                           what="the latest snapshot")
    if got is None:
        raise LookupError("no complete snapshot to restore: take one first (pathways_ray."
                          "elastic.snapshot.take, or DataParallelTrainer's snapshot_every)")
    step, saved_keys, values = got
    if hasattr(shardings, "spec"):
        leaves = [shardings] * len(values)
        keys, treedef = [tuple(k) for k in saved_keys], None
    else:
        keys, leaves, treedef = _paths(shardings, is_leaf=lambda s: hasattr(s, "spec"))
        if sorted(keys) != sorted(tuple(k) for k in saved_keys):
            raise ValueError(f"shardings do not match the snapshot's arrays: theirs "
                             f"{sorted('/'.join(k) for k in saved_keys)}, given "
                             f"{sorted('/'.join(k) for k in keys)}")
    by_key = {tuple(k): v for k, v in zip(saved_keys, values, strict=True)}
    puts = [client.device_put(by_key[k], sh, slice=slice)
            for k, sh in zip(keys, leaves, strict=True)]
    client.block_until_ready(puts, timeout_s)
    if treedef is None:
        from pathways_ray.chips.executor import _nest

        return step, _nest(tuple(keys), puts)
    return step, jax.tree.unflatten(treedef, puts)
