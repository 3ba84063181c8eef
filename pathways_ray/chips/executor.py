"""What a chip worker does with the commands the controller sends it (``commands.py``).

Commands run one after another, in stream order. An exception inside a
command does not stop the worker: the command's outputs are marked failed,
later commands that read them fail the same way, and the error surfaces when
the client fetches. A failure of the user's program becomes ``RemoteError``
(with the remote traceback); a platform failure met while running a command
(the source slice of a put died) keeps its own type, e.g. ``SliceLost``.

``rank`` is the chip's place in its JAX world. The worker hands over the
pieces of a ``Put`` (object refs of the source arrays, or pulls from another
slice's chips) through ``pieces(buffer_id)``, which waits for them to arrive
and returns ``(index, array)`` pairs.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from pathways_ray.chips.checkpoints import Checkpoints
from pathways_ray.errors import PathwaysError, RemoteError
from pathways_ray.programs.hlo_program import HloProgram, is_hlo_blob
from pathways_ray.programs.sharding import MeshShape, Spec, shard_slices
from pathways_ray.transport.commands import (
    Command,
    Compile,
    Free,
    Hold,
    Inline,
    Load,
    Put,
    Reshard,
    Restore,
    Run,
    Save,
    Where,
    devices_of,
    position,
)

logger = logging.getLogger(__name__)

__all__ = ["Executor", "Failed", "RemoteError", "assemble"]


@dataclass(frozen=True)
class Failed:
    """A buffer whose producing command raised: the user's program (``error`` None,
    reported as ``RemoteError``), or the platform or a sidecar (``error`` is that
    failure, raised as it was)."""

    command: str
    traceback: str
    error: PathwaysError | RemoteError | None = None

    def exception(self) -> Exception:
        return self.error if self.error is not None else RemoteError(self.command,
                                                                     self.traceback)


@lru_cache(maxsize=64)  # a weight sync cuts the same parts every iteration
def _cutter(bounds: tuple[tuple[tuple[int, int], ...], ...]):
    """One jitted program that cuts, from each of its arguments, the part whose
    per-axis ``(start, stop)`` are ``bounds[i]``."""
    import jax
    from jax import lax

    def cut(*shards):
        return [lax.slice(x, [a for a, _ in b], [z for _, z in b])
                for x, b in zip(shards, bounds, strict=True)]

    return jax.jit(cut)


def assemble(index: tuple[slice, ...], dtype: str,
             pieces: list[tuple[tuple[slice, ...], np.ndarray]]) -> np.ndarray:
    """Build the block ``index`` of an array from pieces that cover it."""
    shape = tuple(s.stop - s.start for s in index)
    for piece_index, data in pieces:
        if (hasattr(data, "addressable_data") and str(data.dtype) == dtype
                and tuple(data.shape) == shape
                and all((a.start, a.stop) == (b.start, b.stop)
                        for a, b in zip(index, piece_index, strict=True))):
            return data  # pulled onto this chip as exactly the block: no copy at all
        if all(b.start <= a.start and a.stop <= b.stop
               for a, b in zip(index, piece_index, strict=True)):
            # One piece holds the whole block (the same sharding on both sides, or a
            # finer one here): a view of it; the device_put that follows makes the one
            # copy this needs.
            view = np.asarray(data)[tuple(slice(a.start - b.start, a.stop - b.start)
                                          for a, b in zip(index, piece_index, strict=True))]
            if view.shape == shape:  # else (a host's scalar as [x], say) copied below
                return view.astype(dtype, copy=False)
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
        out[dst] = np.reshape(np.asarray(data)[src], out[dst].shape)  # a host's [x] for a scalar
        covered += int(np.prod([high - low for low, high in zip(lo, hi, strict=True)]))
    if covered < out.size:
        raise ValueError(f"pieces cover {covered} of the {out.size} elements of block {index}")
    return out


class Executor(Checkpoints):
    """The buffer table and program cache of one chip, in one JAX world."""

    def __init__(self, rank: int, pieces: Callable[[int], list[tuple[tuple[slice, ...], object]]],
                 give: Callable[[int, object], None] | None = None):
        self.rank = rank
        self._pieces = pieces  # buffer id -> this chip's (index, array) pieces
        self._give = give  # (token, shards or the error) -> held for a sidecar
        self.buffers: dict[int, object] = {}
        self.programs: dict[str, Callable] = {}
        self.compiled: dict[str, Callable] = {}  # compiled ahead (Compile): runs at once
        self._meshes: dict[MeshShape, object] = {}
        self._shardings: dict[tuple, object] = {}
        self._local: dict[str, object] = {}  # memory kind -> this chip's sharding in it
        self.commands_run = 0
        self.batches_run = 0
        self.tracing = False  # a profile is on: each command is a span of its own
        # program -> seconds of its first call: tracing, lowering and compiling (or a
        # persistent compilation cache load); the run itself is asynchronous
        self.first_call_s: dict[str, float] = {}

    def clear(self) -> None:
        """Forget every buffer and program (the chip passes to another lease)."""
        self.buffers.clear()
        self.programs.clear()
        self.compiled.clear()
        self.first_call_s.clear()

    # ---- helpers -------------------------------------------------------------
    def mesh(self, shape: MeshShape, start: Where = 0):
        key = (shape, start)
        if key not in self._meshes:
            import jax
            from jax.sharding import Mesh

            world = jax.devices()
            ids = devices_of(start, shape.size)
            if (max(ids) >= len(world) or min(ids) < 0
                    or position(start, self.rank) < 0):
                raise ValueError(f"mesh {shape} at devices {start} does not fit this chip's "
                                 f"world of {len(world)} devices (chip {self.rank})")
            devices = [world[d] for d in ids]
            if shape.devices is not None:  # a layout in another order than the ranks'
                devices = [devices[r] for r in shape.devices]
            self._meshes[key] = Mesh(np.array(devices).reshape(shape.axis_sizes),
                                     shape.axis_names)
        return self._meshes[key]

    def sharding(self, mesh: MeshShape, spec: Spec, start: Where = 0, memory: str = "device"):
        """One ``NamedSharding`` per layout (and memory kind), reused: JAX caches what it
        works out about a sharding (its devices here) on the object, and a weight sync
        puts the same few layouts every iteration."""
        key = (mesh, spec, start, memory)
        found = self._shardings.get(key)
        if found is None:
            from jax.sharding import NamedSharding, PartitionSpec

            found = self._shardings[key] = NamedSharding(
                self.mesh(mesh, start), PartitionSpec(*[a or None for a in spec]),
                memory_kind=memory)
        return found

    def _in_memory(self, value, memory: str):
        """``value`` (a host array, or this chip's device array) in its memory ``memory``."""
        import jax

        if not isinstance(value, np.ndarray) and value.sharding.memory_kind == memory:
            return value
        if memory not in self._local:
            self._local[memory] = jax.sharding.SingleDeviceSharding(jax.local_devices()[0],
                                                                    memory_kind=memory)
        return jax.device_put(value, self._local[memory])

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

    def local_pieces(self, wanted: list[tuple[int, tuple[tuple[int, int], ...] | None]]
                     ) -> list:
        """Per ``(buffer id, part)``, this chip's shard as a device array, or the part
        of it (``(start, stop)`` per axis; a copy on this chip), to offer to a pull.
        The parts are cut by one XLA program for all of them (``_cutter``): on a TPU
        they never leave the chip, and on a CPU it is one call instead of a host copy
        and a ``device_put`` each.
        Raises like ``local_shard``."""
        shards = []
        for buffer_id, _ in wanted:
            value = self._ok(buffer_id)
            try:
                shard = value.addressable_data(0)
                shard.block_until_ready()  # a failed program raises here, as itself
            except Exception:  # noqa: BLE001
                raise RemoteError(f"computing buffer {buffer_id}",
                                  traceback.format_exc()) from None
            shards.append(self._in_memory(shard, "device"))  # pulls go device to device
        cut = [i for i, (_, part) in enumerate(wanted) if part is not None]
        if cut:
            bounds = tuple(tuple(map(tuple, wanted[i][1])) for i in cut)  # msgpack: lists
            for i, piece in zip(cut, _cutter(bounds)(*[shards[i] for i in cut]), strict=True):
                shards[i] = piece
        return shards

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
            raise value.exception()
        return value

    # ---- commands --------------------------------------------------------------
    def run(self, commands: list[Command]) -> None:
        self.batches_run += 1
        if self.tracing:
            from jax.profiler import TraceAnnotation

            for cmd in commands:
                with TraceAnnotation(_name(cmd)[:40], batch=self.batches_run):
                    self._one(cmd)
            return
        for cmd in commands:
            self._one(cmd)

    def _one(self, cmd: Command) -> None:
        try:
            match cmd:
                case Run():
                    self._run(cmd)
                case Put():
                    self._put(cmd)
                case Reshard():
                    self._reshard(cmd)
                case Free():
                    for i in cmd.buffers:
                        self.buffers.pop(i, None)
                case Load():
                    self._load(cmd)
                case Compile():
                    self._compile(cmd)
                case Hold():
                    self._hold(cmd)
                case Save():
                    self._save(cmd)
                case Restore():
                    self._restore(cmd)
                case _:
                    raise TypeError(f"unknown command {cmd!r}")
        except (PathwaysError, RemoteError) as e:  # the platform, or a sidecar, failed
            self._fail(cmd, Failed(_name(cmd), traceback.format_exc(), e))
        except Exception:  # noqa: BLE001 - recorded on the outputs, worker lives on
            self._fail(cmd, Failed(_name(cmd), traceback.format_exc()))
        self.commands_run += 1

    def _fail(self, cmd: Command, failed: Failed) -> None:
        for out_id in cmd.writes:
            self.buffers[out_id] = failed

    def _load(self, cmd: Load) -> None:
        if cmd.fingerprint in self.programs:
            return
        if is_hlo_blob(cmd.blob):  # compiled by Compile, for its placement
            self.programs[cmd.fingerprint] = HloProgram.from_blob(cmd.blob)
            return
        import jax
        from jax import export

        exp = export.deserialize(bytearray(cmd.blob))
        self.programs[cmd.fingerprint] = jax.jit(exp.call)

    def _compile(self, cmd: Compile) -> None:
        import jax

        program = self.programs.get(cmd.fingerprint)
        if program is None:
            raise KeyError(f"program {cmd.fingerprint} was never loaded on this chip")
        if isinstance(program, HloProgram):
            self._compile_hlo(cmd, program)
            return
        if cmd.fingerprint not in self.compiled:
            t0 = time.monotonic()
            args = [jax.ShapeDtypeStruct(shape, np.dtype(dtype),
                                         sharding=self.sharding(cmd.mesh, spec, cmd.start))
                    for shape, dtype, spec in cmd.in_sigs]
            self.compiled[cmd.fingerprint] = program.lower(*args).compile()
            self.first_call_s.setdefault(cmd.fingerprint, took := time.monotonic() - t0)
            logger.info("program %s: compiled ahead (or loaded from the cache) in %.2f s",
                        cmd.fingerprint[:12], took)
        self.buffers[cmd.status] = self._scalar(np.int32(1), cmd.mesh, cmd.start)

    def _compile_hlo(self, cmd: Compile, program: HloProgram) -> None:
        """Its status is the compiled signature (``HloSignature``), as bytes on every chip."""
        import jax

        from pathways_ray.chips.hlo import compile_hlo

        compiled = self.compiled.get(cmd.fingerprint)
        if compiled is None:
            t0 = time.monotonic()
            compiled = compile_hlo(program, cmd.start, cmd.mesh.size, self.sharding)
            self.compiled[cmd.fingerprint] = compiled
            self.first_call_s[cmd.fingerprint] = time.monotonic() - t0
        data = np.frombuffer(compiled.signature.to_bytes(), dtype=np.uint8)
        self.buffers[cmd.status] = jax.make_array_from_single_device_arrays(
            data.shape, self.sharding(cmd.mesh, ((),), cmd.start),
            [jax.device_put(data, jax.local_devices()[0])])

    def _hold(self, cmd: Hold) -> None:
        """Hand this chip's shards to a sidecar call: a copy in host memory, taken at
        this point of the stream (a later Free cannot reach it)."""
        if position(cmd.start, self.rank) not in cmd.ranks:
            return
        try:
            values = [np.asarray(self._ok(i).addressable_data(0)) for i in cmd.buffers]
        except Exception as e:  # noqa: BLE001 - the sidecar call raises it
            if not isinstance(e, (PathwaysError, RemoteError)):
                e = RemoteError(f"reading buffers {list(cmd.buffers)} for a sidecar",
                                traceback.format_exc())
            self._give(cmd.token, e)
            return
        self._give(cmd.token, values)

    def _scalar(self, value, mesh: MeshShape, start: int):
        """A replicated scalar over the placement: a command's status."""
        import jax

        return jax.make_array_from_single_device_arrays(
            (), self.sharding(mesh, (), start), [jax.device_put(value, jax.local_devices()[0])])

    def _put(self, cmd: Put) -> None:
        import jax

        sharding = self.sharding(cmd.mesh, cmd.spec, cmd.start, cmd.memory)
        if isinstance(cmd.pieces, Inline):  # the data came in the command
            local = cmd.pieces.blocks[cmd.pieces.of_rank[position(cmd.start, self.rank)]]
        else:
            index = shard_slices(cmd.shape, cmd.mesh, cmd.spec)[position(cmd.start, self.rank)]
            local = assemble(index, cmd.dtype, self._pieces(cmd.buffer))
        local = self._in_memory(local, cmd.memory)
        self.buffers[cmd.buffer] = jax.make_array_from_single_device_arrays(
            tuple(cmd.shape), sharding, [local])

    def _run(self, cmd: Run) -> None:
        args = [self.get(i) for i in cmd.inputs]
        for a in args:
            if isinstance(a, Failed):
                for out_id in cmd.outputs:
                    self.buffers[out_id] = a
                return
        program = self.compiled.get(cmd.fingerprint) or self.programs.get(cmd.fingerprint)
        if program is None or isinstance(program, HloProgram):
            raise KeyError(f"program {cmd.fingerprint} was never "
                           f"{'compiled' if program else 'loaded'} on this chip")
        import jax

        if cmd.fingerprint in self.first_call_s:
            outs = jax.tree.leaves(program(*args))
        else:
            t0 = time.monotonic()
            outs = jax.tree.leaves(program(*args))
            self.first_call_s[cmd.fingerprint] = took = time.monotonic() - t0
            logger.info("program %s: first call (trace, lower, compile or cache load) %.2f s",
                        cmd.fingerprint[:12], took)
        for out_id, value in zip(cmd.outputs, outs, strict=True):
            self.buffers[out_id] = value

    def _reshard(self, cmd: Reshard) -> None:
        import jax

        src = self.get(cmd.src)
        self.buffers[cmd.dst] = src if isinstance(src, Failed) else jax.device_put(
            src, self.sharding(cmd.mesh, cmd.spec, cmd.start, cmd.memory))


def _name(cmd: Command) -> str:
    match cmd:
        case Run():
            return f"run {cmd.fingerprint}"
        case _:
            return type(cmd).__name__.lower()
