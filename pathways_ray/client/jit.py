"""``client.jit``: functions exported per argument signature, run where their
arguments live. Tracing and export happen here, on the client; workers never
see the user's Python."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pathways_ray.client.arrays import RemoteArray, spec_of
from pathways_ray.programs.program import Program, export_program

if TYPE_CHECKING:
    from pathways_ray.client.client import Client

__all__ = ["Compiled", "JitFunction", "Lowered", "remote_args"]


class JitFunction:
    """``client.jit(fn)``: exported per argument signature, run where its arguments live."""

    def __init__(self, client: Client, fn, in_shardings=None, out_shardings=None):
        self._client = client
        self.fn = fn
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.programs: dict[tuple, tuple[Program, Any]] = {}

    def _out_specs(self):
        if self.out_shardings is None:
            return None
        import jax

        return jax.tree.map(lambda s: s.spec, self.out_shardings,
                            is_leaf=lambda s: hasattr(s, "spec"))

    def lower(self, *args, platform: str | None = None) -> Lowered:
        """Export for these arguments without running: ``RemoteArray``s, or
        ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(client.mesh(...), spec))``
        for arrays that do not exist yet. ``.compile(slice=...)`` then compiles it there.

        The result runs only with arguments of exactly this signature and mesh
        size; anything else fails on the client, before dispatch, naming the
        argument path and both values. It is exported for ``platform`` (default: that
        of the arguments' slice, or the first slice's for abstract ones).
        """
        (program, out_tree), _ = self._program(*_as_specs(args), platform=platform)
        return Lowered(self._client, program, out_tree)

    def _program(self, *args, platform: str | None = None):
        import jax

        leaves, treedef = jax.tree.flatten(args)
        if all(type(x) is RemoteArray for x in leaves):  # fast path: a signature seen before
            key = (treedef, tuple(a.signature for a in leaves),
                   leaves[0].mesh if leaves else None,
                   self._client._platforms.get(leaves[0].slice) if leaves else None)
            hit = self.programs.get(key)
            if hit is not None and len({a.slice for a in leaves}) == 1:
                return hit, leaves
        arrays, paths, treedef = remote_args(args, getattr(self.fn, "__name__", "program"))
        for a in arrays:  # another client's handle is named before its slice is looked up
            if isinstance(a, RemoteArray):
                self._client._own(a)
        meshes = {a.mesh for a in arrays}
        if len(meshes) != 1:
            raise ValueError(f"{self.fn.__name__}'s arguments use different meshes {meshes}")
        mesh = arrays[0].mesh
        if self.in_shardings is not None:
            want = jax.tree.leaves(self.in_shardings, is_leaf=lambda x: hasattr(x, "spec"))
            if len(want) != len(arrays):
                raise ValueError(f"in_shardings has {len(want)} entries for {len(arrays)} "
                                 f"arguments")
            for p, a, w in zip(paths, arrays, want, strict=True):
                _, spec = spec_of(w, a.ndim)
                if spec != a.spec:
                    raise ValueError(f"Sharding mismatch for {p}: in_shardings says {spec} and "
                                     f"the argument is sharded {a.spec}; reshard it first")
        if platform is None:
            where = arrays[0].slice if arrays and arrays[0].slice is not None else None
            platform = self._client.platform(where) if where else self._client.slices[0].platform
        key = (treedef, tuple(a.signature for a in arrays), mesh, platform)
        if key not in self.programs:
            flat_fn = lambda *flat_args: self.fn(*jax.tree.unflatten(treedef, flat_args))  # noqa: E731
            out_specs = self._out_specs()
            if out_specs is None:
                out_specs = _default_out_specs(flat_fn, arrays)
            program, out_tree = export_program(
                flat_fn, mesh, [a.spec for a in arrays], out_specs,
                [(a.shape, a.dtype) for a in arrays], paths,
                static_name=getattr(self.fn, "__name__", "program"), platform=platform)
            self.programs[key] = (program, out_tree)
        return self.programs[key], arrays

    def __call__(self, *args):
        (program, out_tree), arrays = self._program(*args)
        return self._client._run(program, out_tree, arrays, checked=True)


def remote_args(args: tuple, fun_name: str):
    """Flatten call arguments: every leaf a RemoteArray, all on one slice.

    Returns ``(arrays, paths, treedef)``; paths read like ``args[0]['w']``.
    """
    import jax
    from jax.tree_util import keystr

    flat, treedef = jax.tree_util.tree_flatten_with_path(args)
    paths = [f"args{keystr(p)}" for p, _ in flat]
    arrays = []
    for path, (_, leaf) in zip(paths, flat, strict=True):
        if not isinstance(leaf, (RemoteArray, _Spec)):
            raise TypeError(f"{path} is a {type(leaf).__name__}; pass arrays placed with "
                            f"client.device_put(...)")
        arrays.append(leaf)
    if len({a.slice for a in arrays if a.slice is not None}) > 1:
        where = ", ".join(f"{p} on {a.slice}" for p, a in zip(paths, arrays, strict=True)
                          if a.slice is not None)
        raise ValueError(f"{fun_name}'s arguments live on different slices ({where}); move "
                         f"them with pathways_ray.reshard(x, sharding, slice=...) first")
    return arrays, paths, treedef


def _default_out_specs(flat_fn, arrays: list[RemoteArray]):
    """Output shardings when none are given: the first argument of the same shape's,
    else replicated. (jax.jit lets XLA choose; the client must know them before anything
    runs, so it tells XLA instead.)"""
    import jax
    from jax.sharding import PartitionSpec

    outs = jax.eval_shape(flat_fn, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays])

    def pick(out):
        for a in arrays:
            if a.shape == tuple(out.shape):
                return PartitionSpec(*[x[0] if len(x) == 1 else (x or None) for x in a.spec])
        return PartitionSpec()

    return jax.tree.map(pick, outs)


class Lowered:
    """A program exported for one signature (``JitFunction.lower``); callable as is
    (compiled on its first run), or ``compile()``d on a slice ahead of it."""

    def __init__(self, client: Client, program: Program, out_tree):
        self._client = client
        self.program = program
        self._out_tree = out_tree

    def __call__(self, *args):
        arrays, _, _ = remote_args(args, self.program.fun_name)
        return self._client._run(self.program, self._out_tree, arrays)

    def compile(self, slice: str | int | None = None) -> Compiled:
        """Ship the program to ``slice`` (default: the first) and compile it there now,
        without running it: the first call finds it compiled (or the persistent
        compilation cache fills, for the next client). Returns at once; ``Compiled.
        block_until_ready()`` waits for every chip, and raises a compile error as
        ``RemoteError``."""
        status = self._client._compile(self.program, self._client.slice(slice).name)
        return Compiled(self._client, self.program, self._out_tree, status)


class Compiled(Lowered):
    """A program compiled ahead on a slice (``Lowered.compile``)."""

    def __init__(self, client: Client, program: Program, out_tree, status):
        super().__init__(client, program, out_tree)
        self.status = status  # a RemoteArray: ready once every chip has compiled

    def block_until_ready(self, timeout_s: float | None = None) -> Compiled:
        self.status.block_until_ready(timeout_s)
        return self

    def is_ready(self) -> bool:
        return self.status.is_ready()


class _Spec:
    """An abstract argument for ``lower``: what the export needs of a RemoteArray."""

    def __init__(self, struct, mesh, spec):
        from pathways_ray.programs.program import ArgSignature

        self.shape, self.dtype = tuple(struct.shape), np.dtype(struct.dtype)
        self.mesh, self.spec = mesh, spec
        self.signature = ArgSignature(self.shape, self.dtype.name, spec)
        self.slice = None


def _as_specs(args: tuple) -> tuple:
    """``args`` with each ``jax.ShapeDtypeStruct`` as an abstract argument."""
    import jax

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            if x.sharding is None:
                raise ValueError(f"lower() got jax.ShapeDtypeStruct{x.shape} without a "
                                 f"sharding; give sharding=NamedSharding(client.mesh(...), "
                                 f"PartitionSpec(...))")
            mesh, spec = spec_of(x.sharding, len(x.shape))
            return _Spec(x, mesh, spec)
        return x

    return jax.tree.map(one, args)


