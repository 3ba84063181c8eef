"""Resharding on the client: a new sharding on the same slice (one command), or a copy
to another slice that the chips make themselves (``Controller.transfer``)."""

from __future__ import annotations

from pathways_ray import config
from pathways_ray.client.arrays import RemoteArray, memory_of, spec_of
from pathways_ray.errors import SliceLost
from pathways_ray.transport.commands import Put, Reshard


class Resharding:
    """Mixin of ``Client``: ``reshard``."""

    def reshard(self, x, sharding, slice: str | int | None = None):
        """``x`` (an array or a pytree of them) with another sharding, on its slice or
        on ``slice``. ``sharding``: one for every array, or a matching pytree.

        Across slices the chips copy the shards themselves, all the arrays from one
        slice in one message (``$PATHWAYS_RAY_TRANSFER``: ``pull``, chip to chip over
        JAX's transfer server, or ``objects``, through the hosts' Ray object stores).
        If a source slice is gone this raises ``SliceLost`` naming it, and nothing is
        created on the destination."""
        import jax

        mode = config.transfer_mode()  # a bad setting fails here, before any work
        leaves, treedef = jax.tree.flatten(x)
        shardings = jax.tree.leaves(sharding, is_leaf=lambda s: hasattr(s, "spec"))
        if len(shardings) == 1 and len(leaves) > 1:
            shardings = shardings * len(leaves)
        if len(shardings) != len(leaves):
            raise ValueError(f"sharding has {len(shardings)} leaves for {len(leaves)} arrays; "
                             f"give one sharding, or a pytree matching x")
        target = self.slice(slice) if slice is not None else None
        placed = []  # (array, where, mesh, spec): every argument checked before any work
        for a, sh in zip(leaves, shardings, strict=True):
            if not isinstance(a, RemoteArray):
                raise TypeError(f"reshard takes RemoteArrays, got {type(a).__name__}; "
                                f"use device_put for host arrays")
            self._own(a)
            where = target or self.slice(a.slice)
            mesh, spec = spec_of(sh, a.ndim)
            if mesh.size != where.chips:
                raise ValueError(f"the mesh has {mesh.size} devices; slice {where.name} has "
                                 f"{where.chips} chips")
            placed.append((a, where, mesh, spec, memory_of(sh)))
        out, moves = [], {}  # source slice -> [(array, its copy)]
        for a, where, mesh, spec, memory in placed:
            b = RemoteArray(self, next(self._ids), where.name, a.shape, a.dtype, mesh, spec,
                            memory)
            if where.name == a.slice:
                self._queue.enqueue(where.name, Reshard(a._id, b._id, spec, mesh,
                                                        memory=memory))
            else:
                moves.setdefault(a.slice, []).append((a, b))
            out.append(b)
        for src, pairs in moves.items():
            self._transfer(src, target.name, pairs, mode)
        return out[0] if isinstance(x, RemoteArray) else jax.tree.unflatten(treedef, out)

    def _transfer(self, src: str, dst: str, pairs: list[tuple[RemoteArray, RemoteArray]],
                  mode: str):
        self._sync(src)
        self._sync(dst)
        items = [(a._id, a.mesh, a.spec, Put(b._id, tuple(b.shape), b.dtype.name, b.spec, b.mesh,
                                             memory=b.memory))
                 for a, b in pairs]
        try:
            self._call("transfer", src, dst, items, mode, timeout="fetch", where=src)
        except SliceLost as e:
            self._queue.record(dst if e.slice == dst else src, e)
            raise

