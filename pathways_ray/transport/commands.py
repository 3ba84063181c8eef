"""The commands a chip worker runs, as frozen values. Pure (no Ray, no JAX).

The client builds them, the controller places them (``placed``) and forwards
them over each worker's command stream, the executor dispatches on their type.
Each knows the buffers it reads (``reads``) and writes (``writes``), so a
failed command marks exactly its outputs and the controller can keep its
registry of live buffers without knowing what any command means.

Every worker of a placement receives the same commands in the same order, so
every chip issues the same collectives in the same sequence.

``start`` is the first device of the command's mesh in the JAX world: 0 for a
slice that is a world of its own; a slice's offset, or a multislice group's
first slice's, when several slices share one world. The client leaves it 0;
the controller, which knows the world, sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pathways_ray.programs.sharding import MeshShape, Spec

__all__ = ["Command", "Compile", "Free", "Hold", "HostCall", "Inline", "Load", "Put", "Reshard",
           "Restore", "Run", "Save", "Where", "devices_of", "placed", "position"]

# A put of at most this many bytes (its distinct blocks) travels inside its command.
INLINE_BYTES = 64 << 10
# ... or larger, while every chip of the placement receiving all of it (the batch goes
# whole to each chip) stays within this: a few Ray calls and objects per put cost more.
INLINE_FANOUT_BYTES = 1 << 20

# Where a command's placement is in the JAX world: the first of a run of its devices, or,
# for slices that are not side by side in the world (the survivors of a lost one), all
# of its devices' ids in order.
Where = int | tuple[int, ...]


def devices_of(start: Where, size: int) -> tuple[int, ...]:
    """The world device ids of a placement of ``size`` devices at ``start``."""
    if isinstance(start, tuple):
        if len(start) != size:
            raise ValueError(f"a placement of {len(start)} devices for a mesh of {size}")
        return start
    return tuple(range(start, start + size))


def position(start: Where, rank: int) -> int:
    """Where world device ``rank`` is in the placement at ``start`` (-1: not in it)."""
    if isinstance(start, tuple):
        return start.index(rank) if rank in start else -1
    return rank - start


@dataclass(frozen=True, slots=True)
class Load:
    """Deserialize an exported program and jit it once; later loads are no-ops."""

    fingerprint: str
    blob: bytes

    reads = writes = ()

    def __reduce__(self):  # pickle as (class, fields): half the bytes and time of state dicts
        return (Load, (self.fingerprint, self.blob))

    def __repr__(self) -> str:
        return f"Load({self.fingerprint[:12]})"


@dataclass(frozen=True, slots=True)
class Inline:
    """A small put's data, carried in the command itself (``INLINE_BYTES`` at most, or
    ``INLINE_FANOUT_BYTES`` over all the chips receiving it: a 256 KiB batch on 4 chips
    took 12 ms a step this way, 26.5 ms as 4 objects and 4 calls, ``proxy_ops.py``):
    its distinct blocks, and which block each chip of the placement takes. The same
    bytes reach every chip of the slice in the one batch they all read, with no object
    in Ray's store and no call per chip (a put of a few KiB cost 8 ``ray.put``s and
    8 actor calls on a group of 8 chips: ~70% of a small training step's dispatch)."""

    blocks: tuple  # np.ndarray each
    of_rank: tuple[int, ...]  # rank in the placement -> block


@dataclass(frozen=True, slots=True)
class Put:
    """Assemble this chip's shard of a new buffer from pieces of host arrays.

    ``pieces`` (one list of ``(object ref, index)`` per chip, in device order)
    travel from the client to the controller only: the controller hands each
    chip its own by Ray call (so Ray tracks the refs) and forwards the command
    without them. Pulls from another slice's chips (``pull.Pull``, a cross-slice
    reshard) and a small put's ``Inline`` data are no refs: they stay in the command,
    and each chip takes its own.
    """

    buffer: int
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    mesh: MeshShape
    start: int = 0
    pieces: Any = None
    memory: str = "device"  # the chips' memory it lives in (a JAX memory kind)

    reads = ()

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.buffer,)

    def __reduce__(self):
        return (Put, (self.buffer, self.shape, self.dtype, self.spec, self.mesh, self.start,
                      self.pieces, self.memory))


@dataclass(frozen=True, slots=True)
class Run:
    """Run a loaded program on global arrays; its outputs become new buffers."""

    fingerprint: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @property
    def reads(self) -> tuple[int, ...]:
        return self.inputs

    @property
    def writes(self) -> tuple[int, ...]:
        return self.outputs

    def __reduce__(self):
        return (Run, (self.fingerprint, self.inputs, self.outputs))


@dataclass(frozen=True, slots=True)
class Compile:
    """Compile a loaded program for its signature ahead of its first ``Run``, without
    running it (``client.jit(f).lower(...).compile()``): the first step then only runs.
    ``in_sigs`` are ``(shape, dtype, spec)`` per flat input; ``status`` becomes a
    replicated int32 scalar once every chip has compiled (or the compile error)."""

    fingerprint: str
    in_sigs: tuple[tuple[tuple[int, ...], str, Spec], ...]
    status: int
    mesh: MeshShape
    start: int = 0

    reads = ()

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.status,)

    def __reduce__(self):
        return (Compile, (self.fingerprint, self.in_sigs, self.status, self.mesh, self.start))


@dataclass(frozen=True, slots=True)
class Reshard:
    """The same array on the same chips with another sharding (or in another memory)."""

    src: int
    dst: int
    spec: Spec
    mesh: MeshShape
    start: int = 0
    memory: str = "device"

    @property
    def reads(self) -> tuple[int, ...]:
        return (self.src,)

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.dst,)

    def __reduce__(self):
        return (Reshard, (self.src, self.dst, self.spec, self.mesh, self.start, self.memory))


@dataclass(frozen=True, slots=True)
class Free:
    """Drop buffers. Rides at the end of a batch: every command that reads one of them
    was issued while the client still held its handle, so before the free."""

    buffers: tuple[int, ...]

    reads = writes = ()

    def __reduce__(self):
        return (Free, (self.buffers,))


@dataclass(frozen=True, slots=True)
class Save:
    """Write buffers as one Orbax checkpoint at ``path``, every chip its own shards
    (Orbax's multi-process save over the placement's JAX world). ``keys`` are the
    pytree paths of the inputs; ``status`` becomes a replicated int32 scalar, the
    number of arrays saved, once the checkpoint is committed.

    ``each``: every array its own TensorStore array at ``path/<key>`` instead (what
    Orbax's ``ArrayHandler`` writes without OCDBT, and Cloud Pathways' persistence
    requests ask for), whole once every chip's ``status`` is."""

    path: str
    keys: tuple[tuple[str, ...], ...]
    inputs: tuple[int, ...]
    status: int
    mesh: MeshShape
    start: int = 0
    each: bool = False

    @property
    def reads(self) -> tuple[int, ...]:
        return self.inputs

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.status,)

    def __reduce__(self):
        return (Save, (self.path, self.keys, self.inputs, self.status, self.mesh, self.start,
                       self.each))


@dataclass(frozen=True, slots=True)
class Restore:
    """Read arrays of the Orbax checkpoint at ``path`` into new buffers, every chip
    only its own shards. ``keys``, ``shapes``, ``dtypes`` and ``specs`` are per output;
    ``each``: the arrays are TensorStore arrays at ``path/<key>`` (see ``Save``)."""

    path: str
    keys: tuple[tuple[str, ...], ...]
    outputs: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    specs: tuple[Spec, ...]
    mesh: MeshShape
    start: int = 0
    each: bool = False

    reads = ()

    @property
    def writes(self) -> tuple[int, ...]:
        return self.outputs

    def __reduce__(self):
        return (Restore, (self.path, self.keys, self.outputs, self.shapes, self.dtypes,
                          self.specs, self.mesh, self.start, self.each))


@dataclass(frozen=True, slots=True)
class Hold:
    """Copy this chip's shards of ``buffers`` to host memory under ``token``, for a
    sidecar call to pick up (``ChipWorker.held``). Only the chips whose rank in the
    placement is in ``ranks`` hold (one per distinct block per host)."""

    token: int
    buffers: tuple[int, ...]
    ranks: tuple[int, ...]
    start: int = 0

    writes = ()

    @property
    def reads(self) -> tuple[int, ...]:
        return self.buffers

    def __reduce__(self):
        return (Hold, (self.token, self.buffers, self.ranks, self.start))


@dataclass(frozen=True)
class HostCall:
    """A sidecar call on every host of a slice (``sidecar.py``). It goes from the client
    to the controller only: the controller turns it into a ``Hold`` of the array
    arguments, a call to each host's sidecar, and the ``outputs`` (puts whose pieces
    the sidecars return). ``inputs`` are ``(buffer, shape, dtype, mesh, spec)``;
    ``reply`` (non-zero) keeps each host's return value for the client."""

    spec: dict
    inputs: tuple[tuple[int, tuple[int, ...], str, MeshShape, Spec], ...] = ()
    outputs: tuple[Put, ...] = ()
    reply: int = 0

    @property
    def reads(self) -> tuple[int, ...]:
        return tuple(i[0] for i in self.inputs)

    @property
    def writes(self) -> tuple[int, ...]:
        return tuple(p.buffer for p in self.outputs)


Command = Load | Put | Run | Compile | Reshard | Free | Save | Restore | Hold | HostCall


def placed(cmd: Command, start: int) -> Command:
    """``cmd`` as a worker runs it on a placement whose first device is ``start``
    (a put's pieces stay behind)."""
    match cmd:
        case Put():
            return replace(cmd, start=start, pieces=None)
        case Reshard() | Save() | Restore() | Compile() | Hold() if cmd.start != start:
            return replace(cmd, start=start)
        case _:
            return cmd


def put_pieces(x, index: list, firsts: list, n: int, put) -> tuple[Inline | list, int]:
    """The pieces of a ``Put`` of host array ``x`` on ``n`` chips (``index[r]``: chip
    ``r``'s block, ``firsts[r]``: the first chip with that block), and their bytes: in the
    command itself when small (``Inline``), else one object per distinct block (``put``:
    ``ray.put``)."""
    import numpy as np

    blocks = {r: np.array(x[index[r]], order="C") for r in sorted(set(firsts))}  # (0-d too)
    size = sum(b.nbytes for b in blocks.values())
    if size <= INLINE_BYTES or size * n <= INLINE_FANOUT_BYTES:
        order = {r: i for i, r in enumerate(blocks)}
        return Inline(tuple(blocks.values()), tuple(order[firsts[r]] for r in range(n))), size
    refs = {r: put(b) for r, b in blocks.items()}
    return [[(refs[firsts[r]], index[firsts[r]])] for r in range(n)], size
