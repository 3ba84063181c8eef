"""Checkpoint commands of a chip (a mixin of ``Executor``): Orbax saves and restores
in which every chip of the placement takes part; or (``each``) every array its own
TensorStore array, as Cloud Pathways' persistence requests write and read them."""

from __future__ import annotations

import os

import numpy as np

from pathways_ray.transport.commands import Restore, Save

__all__ = ["Checkpoints"]


class Checkpoints:
    """Mixin of ``Executor``: ``Save`` and ``Restore``."""

    def _save(self, cmd: Save) -> None:
        import orbax.checkpoint as ocp

        from pathways_ray.chips.executor import Failed

        arrays = [self.get(i) for i in cmd.inputs]
        for a in arrays:
            if isinstance(a, Failed):
                self.buffers[cmd.status] = a
                return
        if cmd.each:
            _write_each(self.mesh(cmd.mesh, cmd.start), cmd, arrays)
            self.buffers[cmd.status] = self._scalar(np.int32(len(arrays)), cmd.mesh, cmd.start)
            return
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(cmd.path, _nest(cmd.keys, arrays))
            ckpt.wait_until_finished()  # committed on every chip before the status exists
        self.buffers[cmd.status] = self._scalar(np.int32(len(arrays)), cmd.mesh, cmd.start)

    def _restore(self, cmd: Restore) -> None:
        import jax
        import orbax.checkpoint as ocp

        like = [jax.ShapeDtypeStruct(shape, np.dtype(dtype),
                                     sharding=self.sharding(cmd.mesh, spec, cmd.start))
                for shape, dtype, spec in zip(cmd.shapes, cmd.dtypes, cmd.specs, strict=True)]
        if cmd.each:
            for out_id, value in zip(cmd.outputs, _read_each(cmd, like), strict=True):
                self.buffers[out_id] = value
            return
        with ocp.StandardCheckpointer() as ckpt:
            tree = ckpt.restore(cmd.path, _nest(cmd.keys, like))
        for out_id, key in zip(cmd.outputs, cmd.keys, strict=True):
            value = tree
            for k in key:
                value = value[k]
            self.buffers[out_id] = value


def _spec(path: str, key: tuple[str, ...]) -> dict:
    from jax.experimental.array_serialization import serialization

    where = "/".join([path.rstrip("/"), *key]) if "://" in path else os.path.join(path, *key)
    return serialization.get_tensorstore_spec(where)


def _write_each(mesh, cmd, arrays: list) -> None:
    """Every array at ``cmd.path/<key>``, this chip its own shards (one replica of each
    block is written, by the chip holding it); the placement's first process writes the
    arrays' metadata. The write is whole once every chip's status is (the client waits
    for all of them)."""
    import asyncio

    from jax.experimental.array_serialization import serialization

    first = min(d.process_index for d in mesh.devices.flat)

    async def write() -> None:
        await asyncio.gather(*(serialization.async_serialize(a, _spec(cmd.path, key),
                                                             primary_host=first)
                               for a, key in zip(arrays, cmd.keys, strict=True)))

    asyncio.run(write())


def _read_each(cmd, like: list) -> list:
    """The arrays at ``cmd.path/<key>``, this chip reading its own shards."""
    import asyncio

    from jax.experimental.array_serialization import serialization

    async def read() -> list:
        return await asyncio.gather(*(serialization.async_deserialize(
            x.sharding, _spec(cmd.path, key), global_shape=x.shape, dtype=x.dtype)
            for x, key in zip(like, cmd.keys, strict=True)))

    return asyncio.run(read())


def _nest(keys: tuple[tuple[str, ...], ...], values: list) -> dict:
    """Nested dicts from pytree paths: the tree Orbax writes, and reads back."""
    out: dict = {}
    for key, value in zip(keys, values, strict=True):
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = value
    return out
