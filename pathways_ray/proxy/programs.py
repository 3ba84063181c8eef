"""A session's programs: ``Compile`` of the StableHLO module JAX sends, on the chips of
the slices its devices are on (``HloProgram``), and ``Execute`` of it on the session's
arrays through the client's command streams.

A program runs on all chips of one slice, or of several slices of the session's one
JAX world (a mesh across slices: collectives between them over DCN, gloo here), or
on one device (run on every chip of that device's slice, each on its own copy of the
inputs, so its results are where the slice's next program needs them). Different
programs on different slices run at the same time: one client, many slices (MPMD).
"""

from __future__ import annotations

import logging
import re
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf.message import DecodeError

from pathways_ray.errors import SliceLost
from pathways_ray.programs.hlo_program import HloProgram, HloSignature
from pathways_ray.programs.program import ArgSignature, Program
from pathways_ray.programs.sharding import MeshShape
from pathways_ray.proxy.arrays import ProxyArray
from pathways_ray.proxy.errors import InvalidArgument, Unimplemented
from pathways_ray.proxy.program_parser import ProgramParser
from pathways_ray.proxy.protos import xla_python_pjrt_ifrt_xla_compiler_pb2 as xla_compiler_pb2
from pathways_ray.proxy.protos import xla_xla_data_pb2 as xla_data_pb2
from pathways_ray.proxy.types import Placed, group_ranks

if TYPE_CHECKING:
    from pathways_ray.proxy.arrays import ArrayTable

__all__ = ["Executable", "compile_program", "execute", "prepare"]

logger = logging.getLogger(__name__)


@dataclass
class Executable:
    """A compiled program of the session: where it runs and what it returns. It is
    compiled on what backs its slices when asked (``placed_on``); a slice that was lost
    and came back is backed by its replacement, and the program compiles there again."""

    program: Program
    hlo: HloProgram
    signature: HloSignature | None  # None: its slice was lost before it compiled
    slices: tuple[int, ...]  # the session's slices it runs on
    device_ids: tuple[int, ...]  # the client's devices, in its partition order
    lost: SliceLost | None = None
    placed_on: str = ""  # the client's placement it was compiled for

    @property
    def single(self) -> bool:
        return not self.hlo.ranks


# Debug options that name a file or directory (xla_dump_to, autotune caches, PTX or
# topology files): a client's XLA_FLAGS travel in its compile options, and the chips
# must not write to, or read from, paths a client chooses (MaxText sets
# --xla_dump_to on its own: a dump of every compile landed on the TPU hosts).
_PATHS = re.compile(r"(_to|_from|_dir|_path|_file|_filename)$")


def _confine(options) -> None:
    """Drop the client's debug options that name paths on the hosts (said once, in the
    server's log)."""
    debug = options.executable_build_options.debug_options
    dropped = [f.name for f in debug.DESCRIPTOR.fields
               if f.type == f.TYPE_STRING and _PATHS.search(f.name) and getattr(debug, f.name)]
    for name in dropped:
        debug.ClearField(name)
    for key in [k for k in options.env_option_overrides if _PATHS.search(k)]:
        del options.env_option_overrides[key]
        dropped.append(key)
    if dropped and not _said_dropped.intersection(dropped):
        logger.info("a client's compile options named host paths, not used here: %s",
                    ", ".join(sorted(dropped)))
    _said_dropped.update(dropped)


_said_dropped: set[str] = set()


def compile_program(table: ArrayTable, parser: ProgramParser, program_bytes: bytes,
                    options_bytes: bytes, timeout_s: float | None = None) -> Executable:
    """Compile on the chips of the slice the program's devices are; returns once
    every chip has (raises what the compile met: the user's error, a lost slice).
    ``parser`` reads the client's bytes out of this process."""
    try:
        options = xla_compiler_pb2.XlaCompileOptionsProto.FromString(
            options_bytes).compile_options
    except DecodeError as e:
        raise InvalidArgument(f"the compile options do not parse: {e}") from None
    build = options.executable_build_options
    _confine(options)
    assignment = build.device_assignment
    if assignment.replica_count > 1:
        raise Unimplemented(f"a program over {assignment.replica_count} replicas (pmap) is "
                            f"not served: use jax.jit with shardings")
    if any(len(c.replica_device_ids) != 1 for c in assignment.computation_devices):
        raise InvalidArgument("the device assignment names no device, or several, for a "
                              "computation of one replica")
    device_ids = tuple(c.replica_device_ids[0] for c in assignment.computation_devices)
    if not device_ids:
        device_ids = (0,)
    devices = table.devices
    for d in device_ids:
        if not 0 <= d < len(devices):
            raise InvalidArgument(f"the program is for device {d}; this session has "
                                  f"{len(devices)} devices (0..{len(devices) - 1})")
    slices = tuple(sorted({devices[d].slice_index for d in device_ids}))
    if len(slices) > 1 and not table.joint:
        raise InvalidArgument(
            f"the program spans devices of slices {[table.slice_names[s] for s in slices]}, "
            f"which are separate JAX worlds in this session (slices leased from a shared "
            f"service): put each program's arrays on one slice's devices")
    first = group_ranks(slices, table.chips)
    chips = sum(table.chips[s] for s in slices)
    ranks = (tuple(first[devices[d].slice_index] + devices[d].rank for d in device_ids)
             if len(device_ids) > 1 else ())
    if ranks and sorted(ranks) != list(range(chips)):
        raise InvalidArgument(f"the program runs on {len(ranks)} of the {chips} chips of "
                              f"{table.describe(slices)}: a program here runs on one device or "
                              f"on all chips of its slices")
    name, out_shapes = parser.signature(program_bytes)
    hlo = HloProgram(name, program_bytes, options.SerializeToString(), ranks, tuple(out_shapes))
    program = Program(hlo.fingerprint, name, MeshShape(("chips",), (chips,)), (), (), (),
                      hlo.blob)
    exe = Executable(program, hlo, None, slices, device_ids)
    prepare(table, exe, timeout_s)
    return exe


def prepare(table: ArrayTable, exe: Executable, timeout_s: float | None = None) -> None:
    """Compile ``exe`` on what backs its slices now, unless it is compiled there; a lost
    slice leaves it holding that ``SliceLost`` (raised by its runs), as a Pathways
    server accepts a program for a lost slice and fails its runs with DATA_LOSS
    (pathwaysutils' slice health check compiles for every slice and reads the runs)."""
    try:
        where = table.name(exe.slices)
        if exe.placed_on == where and exe.lost is None:
            return
        status = table.client._compile(exe.program, where)
        signature = HloSignature.from_bytes(
            table.client._fetch_local(status, 0, timeout_s).tobytes())
    except SliceLost as e:
        logger.info("compiling %s: %s", exe.program.fun_name, e)
        exe.lost = e
        return
    out_sigs = tuple(ArgSignature(shape, dtype, spec, mesh) for (shape, dtype), (mesh, spec)
                     in zip(exe.hlo.out_shapes, signature.out_layouts, strict=True))
    exe.program = replace(exe.program, out_sigs=out_sigs)
    exe.signature, exe.lost, exe.placed_on = signature, None, where
    logger.info("compiled %s for %s on %s: %d in, %d out shardings, %d out shapes",
                exe.program.fun_name,
                "one device" if exe.single else f"{len(exe.hlo.ranks)} chips",
                table.describe(exe.slices), len(signature.in_shardings),
                len(signature.out_shardings), len(exe.hlo.out_shapes))


# Per client, per (shape, dtype, block starts): the program that writes one-device
# arrays into their blocks of one array (``assemble_on_chips``).
_ASSEMBLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def assemble_on_chips(table: ArrayTable, parts: list, blocks: list, placed: Placed,
                      arr: ProxyArray):
    """``arr`` (sharded as ``placed``) made of one-device arrays already on the chips of
    its slice (each on every chip there: ``Placed``): a program there writes each into
    its block, and the chips reshard the result into ``arr``'s layout. Nothing comes
    back here (jax copies a batch made on one device to the others this way)."""
    import jax
    import jax.numpy as jnp

    from pathways_ray.client.arrays import Layout

    starts = tuple(tuple(s.start for s in block) for block in blocks)
    key = (arr.shape, arr.dtype.name, starts)
    mine = _ASSEMBLERS.setdefault(table.client, {})
    if key not in mine:
        def assemble(*pieces):
            full = jnp.zeros(arr.shape, arr.dtype)
            for start, piece in zip(starts, pieces, strict=True):
                full = jax.lax.dynamic_update_slice(full, piece, start)
            return full

        mine[key] = table.client.jit(assemble)
    full = mine[key](*parts)
    return table.client.reshard(full, Layout(placed.mesh, placed.spec, arr.memory),
                                slice=table.target(placed.slices))


def execute(table: ArrayTable, exe: Executable, args: list[ProxyArray]) -> list[ProxyArray]:
    """Run ``exe`` on ``args`` (asynchronously: the results are handles at once).
    ``SliceLost`` if its slice is gone."""
    import jax

    prepare(table, exe)  # a slice that came back: compiled there first
    if exe.lost is not None:
        raise exe.lost

    remote = [table.on_chips(a, exe.slices) for a in args]
    n = len(exe.program.out_sigs)
    outs = table.client._run(exe.program, jax.tree.structure([0] * n), remote, checked=True,
                             target=exe.placed_on)
    results = []
    for i, (out, sig) in enumerate(zip(outs, exe.program.out_sigs, strict=True)):
        if exe.single:
            placed = Placed(exe.slices, sig.mesh, sig.spec, device=exe.device_ids[0])
            op = None
        else:
            placed = Placed(exe.slices, sig.mesh, sig.spec)
            op = xla_data_pb2.OpSharding.FromString(exe.signature.out_shardings[i])
        out.memory = exe.signature.out_memory[i]
        results.append(ProxyArray(tuple(sig.shape), np.dtype(sig.dtype), placed,
                                  exe.device_ids, op, remote=out, memory=out.memory))
    table.results(outs)
    return results
