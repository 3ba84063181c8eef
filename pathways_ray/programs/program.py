"""Compiled programs: traced and exported on the client, run SPMD on a slice.

``export_program`` traces a function with ``jax.export`` against an
``AbstractMesh`` — the client never holds the slice's devices — and keeps the
serialized StableHLO with the flat in/out signature. Its fingerprint (a hash
of the serialized module) is what workers cache compiled executables by, so a
program is shipped to a slice once. A program is bound to a mesh size, not to
a slice: any slice with that many chips can run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways_ray.programs.sharding import MeshShape, Spec, normalize_spec

__all__ = ["ArgSignature", "Program", "export_program"]


@dataclass(frozen=True)
class ArgSignature:
    """Shape, dtype and sharding of one flat argument or result; ``mesh`` where it is
    not the program's (a result laid out by the compiler, through the IFRT proxy)."""

    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    mesh: MeshShape | None = None

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)} sharded {_spec_str(self.spec)}"


def _spec_str(spec: Spec) -> str:
    parts = [("None" if not axes else axes[0] if len(axes) == 1 else str(axes)) for axes in spec]
    return "P(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class Program:
    """A serialized SPMD program for a mesh of ``mesh.size`` chips."""

    fingerprint: str
    fun_name: str
    mesh: MeshShape
    in_paths: tuple[str, ...]  # "args[0]['w']" per flat input, for error messages
    in_sigs: tuple[ArgSignature, ...]
    out_sigs: tuple[ArgSignature, ...]
    blob: bytes
    platform: str | None = None  # what it was exported for; None: made for its devices

    def check_args(self, sigs: list[ArgSignature], num_chips: int) -> None:
        """Raise ``ValueError`` naming the argument path and both values on any mismatch."""
        if num_chips != self.mesh.size:
            raise ValueError(
                f"{self.fun_name} was exported for {self.mesh.size} chips and called with "
                f"arrays on a slice of {num_chips} chips"
            )
        if len(sigs) != len(self.in_sigs):
            raise ValueError(f"{self.fun_name} takes {len(self.in_sigs)} arrays and was called "
                             f"with {len(sigs)}")
        for path, want, got in zip(self.in_paths, self.in_sigs, sigs, strict=True):
            if want.dtype != got.dtype:
                raise ValueError(f"Dtype mismatch for {path}: expected {want.dtype} and called "
                                 f"with {got.dtype}")
            if len(want.shape) != len(got.shape):
                raise ValueError(f"Rank mismatch for {path}: expected {len(want.shape)} and "
                                 f"called with {len(got.shape)}")
            for i, (a, b) in enumerate(zip(want.shape, got.shape, strict=True)):
                if a != b:
                    raise ValueError(f"Shape mismatch for {path}.shape[{i}]: expected {a} and "
                                     f"called with {b}")
            if want.spec != got.spec:
                raise ValueError(f"Sharding mismatch for {path}: expected "
                                 f"{_spec_str(want.spec)} and called with {_spec_str(got.spec)}")


def abstract_mesh(axis_sizes: tuple[int, ...], axis_names: tuple[str, ...]):
    """A ``jax.sharding.AbstractMesh`` with ``Auto`` axes: shardings propagate as with
    ``jax.jit`` and ``NamedSharding``. JAX >= 0.11 makes a new abstract mesh's axes
    ``Explicit`` by default, which types every array by its sharding (and Pallas'
    interpret mode then fails on a block of a sharded array)."""
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(tuple(axis_sizes), tuple(axis_names),
                        axis_types=(AxisType.Auto,) * len(axis_sizes))


def export_program(fn, mesh: MeshShape, in_specs: list, out_specs: Any, args: list,
                   in_paths: list[str], static_name: str | None = None,
                   platform: str = "cpu"):
    """Trace ``fn`` on abstract arguments and export it for ``mesh`` of ``platform``'s
    chips ("tpu", or "cpu" on the emulated fleet).

    ``args`` are flat ``(shape, dtype)`` pairs and ``in_specs`` their normalized
    specs; ``out_specs`` is a pytree prefix of ``PartitionSpec`` for the results.
    For "cpu", Pallas kernels are traced in Pallas' interpret mode (plain HLO), so
    code written for TPU runs, and is tested, on the emulated fleet.
    Returns ``(program, out_treedef)``.
    """
    import jax
    from jax import export
    from jax.sharding import NamedSharding, PartitionSpec

    amesh = abstract_mesh(mesh.axis_sizes, mesh.axis_names)
    in_shardings = [NamedSharding(amesh, PartitionSpec(*s)) for s in in_specs]
    avals = [jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
             for (shape, dtype), sh in zip(args, in_shardings, strict=True)]

    # PartitionSpec is a tuple subclass: only it may be a leaf, not a tuple of specs.
    out_shardings = None if out_specs is None else jax.tree.map(
        lambda p: NamedSharding(amesh, p), out_specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec))
    if platform not in ("cpu", "tpu"):
        raise ValueError(f"platform={platform!r} must be 'cpu' or 'tpu'")
    jitted = jax.jit(fn, in_shardings=tuple(in_shardings), out_shardings=out_shardings)
    with _pallas_interpreted(platform == "cpu"):
        exp = export.export(jitted, platforms=[platform])(*avals)
    out_tree = exp.out_tree
    # The chips take the results as a flat list (the client rebuilds their structure
    # from ``out_tree``), and jax.export cannot serialize a result tree holding a named
    # tuple it does not know (an optax state): the program goes out with a flat one.
    flat = jax.tree.structure(tuple(range(out_tree.num_leaves)))
    blob = bytes(dataclasses.replace(exp, out_tree=flat).serialize())
    out_sigs = []
    for aval, sharding in zip(exp.out_avals, exp.out_shardings_jax(amesh), strict=True):
        spec = tuple(sharding.spec) if sharding is not None else ()
        out_sigs.append(ArgSignature(tuple(aval.shape), np.dtype(aval.dtype).name,
                                     normalize_spec(spec, len(aval.shape), mesh)))
    in_sigs = tuple(ArgSignature(tuple(shape), np.dtype(dtype).name,
                                 normalize_spec(spec, len(shape), mesh))
                    for (shape, dtype), spec in zip(args, in_specs, strict=True))
    program = Program(
        fingerprint=hashlib.sha256(blob).hexdigest()[:32],
        fun_name=static_name or getattr(fn, "__name__", "program"),
        mesh=mesh,
        in_paths=tuple(in_paths),
        in_sigs=in_sigs,
        out_sigs=tuple(out_sigs),
        blob=blob,
        platform=platform,
    )
    return program, out_tree


@contextlib.contextmanager
def _pallas_interpreted(on: bool):
    """Trace Pallas kernels in interpret mode (``pallas_call(interpret=True)``: plain
    HLO, which CPUs run and exports keep)."""
    if not on:
        yield
        return
    from jax._src import config

    prev = config.pallas_tpu_interpret_mode_context_manager.swap_local(True)
    try:
        yield
    finally:
        config.pallas_tpu_interpret_mode_context_manager.set_local(prev)
