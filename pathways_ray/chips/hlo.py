"""A chip's side of an ``HloProgram`` (the module JAX sent through the IFRT proxy):
compile it for the placement's devices in the client's partition order, and run it on
the chip's buffers.

The compile options are the client's own (its partitioner, its flags), with the
device assignment made this world's; the compile goes through JAX's persistent
compilation cache, as the chips' own programs do. Results become global ``jax.Array``s laid out
as XLA chose (``programs.hlo_sharding.layout_of``), so the next command, a fetch or
a copy to another slice treats them as any other buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from pathways_ray.programs.hlo_program import HloProgram, HloSignature
from pathways_ray.programs.hlo_sharding import layout_of, replicated
from pathways_ray.programs.sharding import MeshShape, Spec
from pathways_ray.transport.commands import Where, devices_of

__all__ = ["CompiledHlo", "compile_hlo"]

logger = logging.getLogger(__name__)


class CompiledHlo:
    """A loaded executable for one placement; called with the chip's input buffers,
    returns its results as global arrays."""

    def __init__(self, program: HloProgram, executable, signature: HloSignature, start: int,
                 sharding: Callable[[MeshShape, Spec, int, str], object]):
        self.program = program
        self.executable = executable
        self.signature = signature
        self._start = start
        self._sharding = sharding

    def __call__(self, *args):
        import jax

        if not self.program.ranks:  # one device: this chip runs it on its own copy
            args = [a.addressable_data(0) for a in args]
        results = self.executable.execute_sharded(list(args))
        outs = results.disassemble_into_single_device_arrays()
        return [jax.make_array_from_single_device_arrays(
                    shape, self._sharding(mesh, spec, self._start, memory), pieces)
                for (shape, _), (mesh, spec), memory, pieces
                in zip(self.program.out_shapes, self.signature.out_layouts,
                       self.signature.out_memory, outs, strict=True)]


def _compile_or_load(module: bytes, devices: list, options):
    """Compile through JAX's persistent compilation cache (a hit loads the executable
    another process compiled), as JAX's own jit does."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        try:
            parsed = xc._xla.mlir.deserialize_portable_artifact(module)
        except Exception:  # noqa: BLE001 - not an artifact: plain bytecode or text
            parsed = ir.Module.parse(module)
        return compiler.compile_or_get_cached(devices[0].client, parsed, np.array(devices),
                                              options, [], xc.DeviceList(tuple(devices)))


def _memory_stats(executable) -> dict[str, int] | None:
    """XLA's account of the executable's memory on one chip (``memory_analysis()``):
    its sizes, not the buffer assignment."""
    try:
        stats = executable.get_compiled_memory_stats()
    except Exception:  # noqa: BLE001 - a backend that does not say
        return None
    return {k: int(getattr(stats, k)) for k in dir(stats)
            if k.endswith(("_bytes", "_allocations")) and isinstance(getattr(stats, k), int)}


def compile_hlo(program: HloProgram, start: Where, chips: int,
                sharding: Callable[[MeshShape, Spec, int, str], object]) -> CompiledHlo:
    """Compile ``program`` for the placement of ``chips`` chips at world device
    ``start`` (every chip of it calls this)."""
    import jax
    from jax._src.lib import xla_client as xc

    world = jax.devices()
    ids = devices_of(start, chips)
    devices = ([world[ids[r]] for r in program.ranks] if program.ranks
               else [jax.local_devices()[0]])
    options = xc.CompileOptions.ParseFromString(program.compile_options)
    options.device_assignment = xc.DeviceAssignment.create(
        np.array([[d.id for d in devices]]))
    t0 = time.monotonic()
    executable = _compile_or_load(program.module, devices, options)
    logger.info("program %s (%s): compiled for %d devices in %.2f s", program.fingerprint[:12],
                program.name, len(devices), time.monotonic() - t0)
    outs = executable.get_output_shardings() or []
    ins = executable.get_parameter_shardings() or []
    if program.ranks:
        layouts = tuple(layout_of(op, program.ranks, len(shape), chips)
                        for op, (shape, _) in zip(outs, program.out_shapes, strict=True))
    else:
        layouts = tuple(replicated(chips, len(shape)) for shape, _ in program.out_shapes)
    kinds = executable.get_output_memory_kinds()
    out_memory = (tuple(kinds[0]) if kinds and len(kinds[0]) == len(program.out_shapes)
                  else ("device",) * len(program.out_shapes))
    signature = HloSignature(layouts, tuple(op.SerializeToString() for op in ins),
                             tuple(op.SerializeToString() for op in outs),
                             _memory_stats(executable), out_memory)
    return CompiledHlo(program, executable, signature, start, sharding)
