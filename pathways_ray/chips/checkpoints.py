"""Checkpoint commands of a chip (a mixin of ``Executor``): Orbax saves and restores
in which every chip of the placement takes part."""

from __future__ import annotations

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
        with ocp.StandardCheckpointer() as ckpt:
            tree = ckpt.restore(cmd.path, _nest(cmd.keys, like))
        for out_id, key in zip(cmd.outputs, cmd.keys, strict=True):
            value = tree
            for k in key:
                value = value[k]
            self.buffers[out_id] = value


def _nest(keys: tuple[tuple[str, ...], ...], values: list) -> dict:
    """Nested dicts from pytree paths: the tree Orbax writes, and reads back."""
    out: dict = {}
    for key, value in zip(keys, values, strict=True):
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = value
    return out
