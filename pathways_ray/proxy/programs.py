"""A session's programs: ``Compile`` of the StableHLO module JAX sends, on the chips of
the slice its devices are (``HloProgram``), and ``Execute`` of it on the session's
arrays through the client's command streams.

A program runs on one slice: on all of its chips (a mesh of that slice's devices),
or on one device (run on every chip of that device's slice, each on its own copy of
the inputs, so its results are where the slice's next program needs them). Different
programs on different slices run at the same time: one client, many slices (MPMD).
"""

from __future__ import annotations

import logging
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
from pathways_ray.proxy.types import Placed

if TYPE_CHECKING:
    from pathways_ray.proxy.arrays import ArrayTable

__all__ = ["Executable", "compile_program", "execute"]

logger = logging.getLogger(__name__)


@dataclass
class Executable:
    """A compiled program of the session: where it runs and what it returns."""

    program: Program
    hlo: HloProgram
    signature: HloSignature | None  # None: its slice was lost before it compiled
    slice_index: int
    device_ids: tuple[int, ...]  # the client's devices, in its partition order
    lost: SliceLost | None = None

    @property
    def single(self) -> bool:
        return not self.hlo.ranks


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
    slices = sorted({devices[d].slice_index for d in device_ids})
    if len(slices) > 1:
        raise InvalidArgument(
            f"the program spans devices of slices "
            f"{[table.slice_names[s] for s in slices]}: a program runs on one slice here "
            f"(meshes across slices are not served yet); put each program's arrays on one "
            f"slice's devices")
    s = slices[0]
    ranks = tuple(devices[d].rank for d in device_ids) if len(device_ids) > 1 else ()
    if ranks and sorted(ranks) != list(range(table.chips[s])):
        raise InvalidArgument(f"the program runs on {len(ranks)} of the {table.chips[s]} chips "
                              f"of slice {table.slice_names[s]}: a program here runs on one "
                              f"device or on all chips of a slice")
    name, out_shapes = parser.signature(program_bytes)
    hlo = HloProgram(name, program_bytes, options.SerializeToString(), ranks, tuple(out_shapes))
    chips = table.chips[s]
    program = Program(hlo.fingerprint, name, MeshShape(("chips",), (chips,)), (), (), (),
                      hlo.blob)
    try:
        status = table.client._compile(program, table.slice_names[s])
        signature = HloSignature.from_bytes(
            table.client._fetch_local(status, 0, timeout_s).tobytes())
    except SliceLost as e:
        # As a Pathways server does: the program is accepted, and each run of it fails
        # with DATA_LOSS (pathwaysutils' slice health check compiles for every slice
        # and looks for that word in the runs' errors).
        logger.warning("compiling %s: %s", name, e)
        return Executable(program, hlo, None, s, device_ids, lost=e)
    out_sigs = tuple(ArgSignature(shape, dtype, spec, mesh) for (shape, dtype), (mesh, spec)
                     in zip(out_shapes, signature.out_layouts, strict=True))
    logger.info("compiled %s for %s on slice %s: %d in, %d out shardings, %d out shapes", name,
                "one device" if not ranks else f"{len(ranks)} chips", table.slice_names[s],
                len(signature.in_shardings), len(signature.out_shardings), len(out_shapes))
    return Executable(replace(program, out_sigs=out_sigs), hlo, signature, s, device_ids)


def execute(table: ArrayTable, exe: Executable, args: list[ProxyArray]) -> list[ProxyArray]:
    """Run ``exe`` on ``args`` (asynchronously: the results are handles at once).
    ``SliceLost`` if its slice is gone."""
    import jax

    if exe.lost is not None:
        raise exe.lost

    remote = [table.on_chips(a, exe.slice_index) for a in args]
    n = len(exe.program.out_sigs)
    outs = table.client._run(exe.program, jax.tree.structure([0] * n), remote, checked=True,
                             target=table.slice_names[exe.slice_index])
    results = []
    for i, (out, sig) in enumerate(zip(outs, exe.program.out_sigs, strict=True)):
        if exe.single:
            placed = Placed(exe.slice_index, sig.mesh, sig.spec, device=exe.device_ids[0])
            op = None
        else:
            placed = Placed(exe.slice_index, sig.mesh, sig.spec)
            op = xla_data_pb2.OpSharding.FromString(exe.signature.out_shardings[i])
        results.append(ProxyArray(tuple(sig.shape), np.dtype(sig.dtype), placed,
                                  exe.device_ids, op, remote=out))
    return results
