"""What a chip worker does with the commands the controller sends it.

Every worker of a slice receives the same commands in the same order and runs
them one after another, so every chip issues the same collectives in the same
sequence. Commands are plain tuples:

    ("load", fingerprint, blob)                    deserialize + jit once, cached
    ("put", id, shape, dtype, spec, mesh, start)   this chip's shard, from its pieces
    ("run", fingerprint, in_ids, out_ids)          run a program on global arrays
    ("reshard", src_id, dst_id, spec, mesh, start) same chips, another sharding
    ("free", ids)                                   drop buffers

An exception inside a command does not stop the worker: the command's
outputs are marked failed with the remote traceback, later commands that use
them fail the same way, and the error surfaces when the client fetches.

``start`` is the first device of the mesh in the JAX world: 0 for a slice
that is a world of its own; a slice's offset, or a multislice mesh's first
slice's, when several slices share one world. ``rank`` is the chip's place
in that world.

The pieces of a ``put`` (object refs of the source arrays) do not travel in
the command: the worker hands them over through ``pieces(buffer_id)``, which
waits for them to arrive and returns ``(index, array)`` pairs.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pathways_ray.sharding import MeshShape, Spec, shard_slices

__all__ = ["Executor", "Failed", "assemble"]


@dataclass(frozen=True)
class Failed:
    """A buffer whose producing command raised."""

    command: str
    traceback: str


def assemble(index: tuple[slice, ...], dtype: str,
             pieces: list[tuple[tuple[slice, ...], np.ndarray]]) -> np.ndarray:
    """Build the block ``index`` of an array from pieces that cover it."""
    shape = tuple(s.stop - s.start for s in index)
    if len(pieces) == 1 and pieces[0][0] == index and pieces[0][1].shape == shape:
        # The common case (same sharding on both sides): the piece is the block; the
        # device_put that follows makes the one copy this needs.
        return np.asarray(pieces[0][1]).astype(dtype, copy=False)
    out = np.empty(shape, dtype=dtype)
    covered = 0
    for piece_index, data in pieces:
        lo = [max(a.start, b.start) for a, b in zip(index, piece_index, strict=True)]
        hi = [min(a.stop, b.stop) for a, b in zip(index, piece_index, strict=True)]
        if any(low >= high for low, high in zip(lo, hi, strict=True)):
            continue
        dst = tuple(slice(low - a.start, high - a.start)
                    for low, high, a in zip(lo, hi, index, strict=True))
        src = tuple(slice(low - b.start, high - b.start)
                    for low, high, b in zip(lo, hi, piece_index, strict=True))
        out[dst] = data[src]
        covered += int(np.prod([high - low for low, high in zip(lo, hi, strict=True)]))
    if covered < out.size:
        raise ValueError(f"pieces cover {covered} of the {out.size} elements of block {index}")
    return out


class Executor:
    """The buffer table and program cache of one chip, in one JAX world."""

    def __init__(self, rank: int, pieces: Callable[[int], list[tuple[tuple[slice, ...], object]]]):
        self.rank = rank
        self._pieces = pieces  # buffer id -> this chip's (index, array) pieces
        self.buffers: dict[int, object] = {}
        self.programs: dict[str, Callable] = {}
        self._meshes: dict[MeshShape, object] = {}
        self.commands_run = 0
        self.batches_run = 0

    # ---- helpers -------------------------------------------------------------
    def mesh(self, shape: MeshShape, start: int = 0):
        key = (shape, start)
        if key not in self._meshes:
            import jax
            from jax.sharding import Mesh

            world = jax.devices()
            devices = world[start:start + shape.size]
            if len(devices) != shape.size or not start <= self.rank < start + shape.size:
                raise ValueError(f"mesh {shape} at device {start} does not fit this chip's "
                                 f"world of {len(world)} devices (chip {self.rank})")
            self._meshes[key] = Mesh(np.array(devices).reshape(shape.axis_sizes),
                                     shape.axis_names)
        return self._meshes[key]

    def sharding(self, mesh: MeshShape, spec: Spec, start: int = 0):
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh(mesh, start), PartitionSpec(*[a or None for a in spec]))

    def get(self, buffer_id: int):
        value = self.buffers.get(buffer_id)
        if value is None:
            raise KeyError(f"buffer {buffer_id} is not on this chip (freed, or never created)")
        return value

    def local_shard(self, buffer_id: int) -> np.ndarray:
        """This chip's shard. Raises ``RemoteError`` if the buffer's command failed —
        also when the failure shows only now (XLA runs programs asynchronously)."""
        value = self._ok(buffer_id)
        try:
            return np.asarray(value.addressable_data(0))
        except Exception:  # noqa: BLE001
            raise RemoteError(f"computing buffer {buffer_id}", traceback.format_exc()) from None

    def ready(self, buffer_ids: list[int]) -> None:
        for buffer_id in buffer_ids:
            value = self._ok(buffer_id)
            try:
                value.block_until_ready()
            except Exception:  # noqa: BLE001
                raise RemoteError(f"computing buffer {buffer_id}",
                                  traceback.format_exc()) from None

    def _ok(self, buffer_id: int):
        try:
            value = self.get(buffer_id)
        except KeyError as e:
            raise RemoteError(f"reading buffer {buffer_id}", str(e)) from None
        if isinstance(value, Failed):
            raise RemoteError(value.command, value.traceback)
        return value

    # ---- commands --------------------------------------------------------------
    def run(self, commands: list[tuple]) -> None:
        self.batches_run += 1
        for cmd in commands:
            op = cmd[0]
            try:
                getattr(self, "_" + op)(*cmd[1:])
            except Exception:  # noqa: BLE001 - recorded on the outputs, worker lives on
                self._fail(cmd, traceback.format_exc())
            self.commands_run += 1

    def repeat(self, fingerprint: str, buffer_id: int, k: int) -> float:
        """Multi-controller mode: run ``z = program(z)`` k times from this process alone
        (every worker of the slice does the same), return the seconds it took."""
        import time

        prog = self.programs[fingerprint]
        z = self._ok(buffer_id)
        t0 = time.perf_counter()
        for _ in range(k):
            z = prog(z)
        z.block_until_ready()
        return time.perf_counter() - t0

    def _fail(self, cmd: tuple, tb: str) -> None:
        op = cmd[0]
        failed = Failed(f"{op} {cmd[1] if op == 'run' else ''}".strip(), tb)
        outs = {"run": lambda: cmd[3], "put": lambda: [cmd[1]],
                "reshard": lambda: [cmd[2]]}.get(op, lambda: [])()
        for out_id in outs:
            self.buffers[out_id] = failed

    def _load(self, fingerprint: str, blob: bytes) -> None:
        if fingerprint in self.programs:
            return
        import jax
        from jax import export

        exp = export.deserialize(bytearray(blob))
        self.programs[fingerprint] = jax.jit(exp.call)

    def _put(self, buffer_id: int, shape, dtype, spec, mesh: MeshShape, start: int = 0) -> None:
        import jax

        sharding = self.sharding(mesh, spec, start)
        index = shard_slices(shape, mesh, spec)[self.rank - start]
        local = assemble(index, dtype, self._pieces(buffer_id))
        device = jax.local_devices()[0]
        self.buffers[buffer_id] = jax.make_array_from_single_device_arrays(
            tuple(shape), sharding, [jax.device_put(local, device)])

    def _run(self, fingerprint: str, in_ids: list[int], out_ids: list[int]) -> None:
        args = [self.get(i) for i in in_ids]
        for a in args:
            if isinstance(a, Failed):
                for out_id in out_ids:
                    self.buffers[out_id] = a
                return
        if fingerprint not in self.programs:
            raise KeyError(f"program {fingerprint} was never loaded on this chip")
        outs = self.programs[fingerprint](*args)
        import jax

        for out_id, value in zip(out_ids, jax.tree.leaves(outs), strict=True):
            self.buffers[out_id] = value

    def _reshard(self, src_id: int, dst_id: int, spec, mesh: MeshShape, start: int = 0) -> None:
        import jax

        src = self.get(src_id)
        if isinstance(src, Failed):
            self.buffers[dst_id] = src
            return
        self.buffers[dst_id] = jax.device_put(src, self.sharding(mesh, spec, start))

    def _free(self, ids: list[int]) -> None:
        for i in ids:
            self.buffers.pop(i, None)


class RemoteError(RuntimeError):
    """A command failed on a chip worker; carries the remote traceback."""

    def __init__(self, command: str, remote_traceback: str):
        self.command = command
        self.remote_traceback = remote_traceback
        super().__init__(f"{command} failed on the slice:\n{remote_traceback}")

    def __reduce__(self):
        return (RemoteError, (self.command, self.remote_traceback))
