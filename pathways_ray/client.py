"""What user code holds: ``pathways_ray.connect()`` returns a ``Client``.

The client traces and exports functions (``client.jit``), allocates array
handles itself (so a call returns at once, before anything ran) and batches
commands per slice: a batch goes to the controller when it is full, when the
client needs a result (``fetch``, ``block_until_ready``, a cross-slice
reshard), or after ``flush_interval_s``. Results are ``RemoteArray`` handles
whose bytes stay on the chip workers.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways_ray.executor import RemoteError, assemble
from pathways_ray.program import ArgSignature, Program, export_program
from pathways_ray.sharding import MeshShape, Spec, normalize_spec, shard_slices, unique_shards

logger = logging.getLogger(__name__)

__all__ = ["Client", "Compiled", "JitFunction", "RemoteArray", "SliceInfo", "connect", "reshard"]


@dataclass(frozen=True)
class SliceInfo:
    name: str
    topology: str
    chips: int


def _mesh_shape(mesh) -> MeshShape:
    return MeshShape(tuple(mesh.axis_names), tuple(int(n) for n in mesh.axis_sizes))


def _spec_of(sharding, ndim: int) -> tuple[MeshShape, Spec]:
    from jax.sharding import NamedSharding

    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding={sharding!r} must be a jax.sharding.NamedSharding over "
                        f"client.mesh(...)")
    mesh = _mesh_shape(sharding.mesh)
    return mesh, normalize_spec(tuple(sharding.spec), ndim, mesh)


class RemoteArray:
    """A handle to an array on a slice: shape, dtype and sharding are here, bytes are not."""

    __slots__ = ("__weakref__", "_client", "_id", "_sig", "dtype", "mesh", "shape", "slice",
                 "spec")

    def __init__(self, client: Client, buffer_id: int, slice_name: str, shape, dtype,
                 mesh: MeshShape, spec: Spec):
        self._client = client
        self._id = buffer_id
        self.slice = slice_name
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.mesh = mesh
        self.spec = spec
        self._sig = ArgSignature(self.shape, self.dtype.name, spec)  # hashed on every call
        weakref.finalize(self, client._free, slice_name, buffer_id)

    @property
    def sharding(self):
        from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

        return NamedSharding(AbstractMesh(self.mesh.axis_sizes, self.mesh.axis_names),
                             PartitionSpec(*[a[0] if len(a) == 1 else (a or None)
                                             for a in self.spec]))

    @property
    def signature(self) -> ArgSignature:
        return self._sig

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def fetch(self, timeout_s: float = 300.0) -> np.ndarray:
        """Bring the array to the client (waits for the work that produces it)."""
        return self._client._fetch(self, timeout_s)

    def __array__(self, dtype=None, copy=None):
        out = self.fetch()
        return out.astype(dtype) if dtype is not None else out

    def block_until_ready(self, timeout_s: float = 300.0) -> RemoteArray:
        self._client._ready(self.slice, [self._id], timeout_s)
        return self

    def __repr__(self) -> str:
        return (f"RemoteArray({self.dtype.name}{list(self.shape)}, slice={self.slice!r}, "
                f"spec={self.spec})")


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

    def lower(self, *args) -> Compiled:
        """Export for these arguments (RemoteArrays) without running.

        The result runs only with arguments of exactly this signature and mesh
        size; anything else fails on the client, before dispatch, naming the
        argument path and both values.
        """
        (program, out_tree), _ = self._program(*args)
        return Compiled(self._client, program, out_tree)

    def _program(self, *args):
        import jax

        leaves, treedef = jax.tree.flatten(args)
        if all(type(x) is RemoteArray for x in leaves):  # fast path: a signature seen before
            key = (treedef, tuple(a.signature for a in leaves), leaves[0].mesh if leaves else None)
            hit = self.programs.get(key)
            if hit is not None and len({a.slice for a in leaves}) == 1:
                return hit, leaves
        arrays, paths, treedef = _remote_args(args, getattr(self.fn, "__name__", "program"))
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
                _, spec = _spec_of(w, a.ndim)
                if spec != a.spec:
                    raise ValueError(f"Sharding mismatch for {p}: in_shardings says {spec} and "
                                     f"the argument is sharded {a.spec}; reshard it first")
        key = (treedef, tuple(a.signature for a in arrays), mesh)
        if key not in self.programs:
            flat_fn = lambda *flat_args: self.fn(*jax.tree.unflatten(treedef, flat_args))  # noqa: E731
            out_specs = self._out_specs()
            if out_specs is None:
                out_specs = _default_out_specs(flat_fn, arrays)
            program, out_tree = export_program(
                flat_fn, mesh, [a.spec for a in arrays], out_specs,
                [(a.shape, a.dtype) for a in arrays], paths,
                static_name=getattr(self.fn, "__name__", "program"))
            self.programs[key] = (program, out_tree)
        return self.programs[key], arrays

    def __call__(self, *args):
        (program, out_tree), arrays = self._program(*args)
        return self._client._run(program, out_tree, arrays, checked=True)


def _remote_args(args: tuple, fun_name: str):
    """Flatten call arguments: every leaf a RemoteArray, all on one slice.

    Returns ``(arrays, paths, treedef)``; paths read like ``args[0]['w']``.
    """
    import jax
    from jax.tree_util import keystr

    flat, treedef = jax.tree_util.tree_flatten_with_path(args)
    paths = [f"args{keystr(p)}" for p, _ in flat]
    arrays = []
    for path, (_, leaf) in zip(paths, flat, strict=True):
        if not isinstance(leaf, RemoteArray):
            raise TypeError(f"{path} is a {type(leaf).__name__}; pass arrays placed with "
                            f"client.device_put(...)")
        arrays.append(leaf)
    if len({a.slice for a in arrays}) > 1:
        where = ", ".join(f"{p} on {a.slice}" for p, a in zip(paths, arrays, strict=True))
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


class Compiled:
    """A program exported for one signature (``JitFunction.lower``)."""

    def __init__(self, client: Client, program: Program, out_tree):
        self._client = client
        self.program = program
        self._out_tree = out_tree

    def __call__(self, *args):
        arrays, _, _ = _remote_args(args, self.program.fun_name)
        return self._client._run(self.program, self._out_tree, arrays)


class Client:
    """The single-controller client. Make one with ``pathways_ray.connect()``."""

    def __init__(self, controller, max_batch: int = 64, flush_interval_s: float = 0.010):
        import ray

        self._controller = controller
        self.slices = [SliceInfo(d["name"], d["topology"], d["chips"])
                       for d in ray.get(controller.describe.remote(), timeout=600)]
        self._chips = {s.name: s.chips for s in self.slices}
        self._groups: dict[str, SliceInfo] = {}  # multislice placements, by name
        self._members: dict[str, frozenset[str]] = {s.name: frozenset([s.name])
                                                   for s in self.slices}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._pending: dict[str, list] = {s.name: [] for s in self.slices}
        # Frees wait for the end of their batch: every command that reads a buffer was
        # issued while the client still held its handle, so before its free.
        self._frees: dict[str, list[int]] = {s.name: [] for s in self.slices}
        self._last_flush: dict[str, float] = {s.name: 0.0 for s in self.slices}
        self._submitted: deque = deque()
        self._registered: set[str] = set()
        self.max_batch = max_batch
        self._closed = False
        self._flush_interval_s = flush_interval_s
        self._wake = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                         name="pathways-ray-flush")
        self._flusher.start()

    # ---- placement -----------------------------------------------------------
    def slice(self, name_or_index: str | int | list | tuple | None = None) -> SliceInfo:
        """A slice by name or index, or a list of them: several slices of one JAX world
        (``connect(multislice=True)``), where one mesh spans their chips."""
        if name_or_index is None:
            return self.slices[0]
        if isinstance(name_or_index, (list, tuple)):
            return self._group([self.slice(x).name for x in name_or_index])
        if isinstance(name_or_index, int):
            return self.slices[name_or_index]
        for s in self.slices:
            if s.name == name_or_index:
                return s
        if name_or_index in self._groups:
            return self._groups[name_or_index]
        raise ValueError(f"slice={name_or_index!r} is not one of "
                         f"{[s.name for s in self.slices]}")

    def _group(self, names: list[str]) -> SliceInfo:
        import ray

        key = "+".join(names)
        if key not in self._groups:
            info = ray.get(self._controller.group.remote(names), timeout=60)
            with self._lock:
                g = SliceInfo(info["name"], info["topology"], info["chips"])
                self._groups[g.name] = g
                self._chips[g.name] = g.chips
                self._members[g.name] = frozenset(names)
                self._pending[g.name], self._frees[g.name] = [], []
                self._last_flush[g.name] = 0.0
        return self._groups[key]

    def mesh(self, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...],
             slices: list | None = None):
        """An abstract mesh (``jax.sharding.AbstractMesh``) over the chips of a slice, or
        over the chips of several ``slices`` (names or indices) of one JAX world, slice
        after slice: put the slice axis first, ``(len(slices), ...)``."""
        from jax.sharding import AbstractMesh

        shape = MeshShape(tuple(axis_names), tuple(axis_sizes))  # checks
        if slices is not None:
            group = self.slice(list(slices))
            if shape.size != group.chips:
                raise ValueError(f"axis_sizes={tuple(axis_sizes)} make {shape.size} devices; "
                                 f"slices {group.name} have {group.chips} chips")
        return AbstractMesh(tuple(axis_sizes), tuple(axis_names))

    def jit(self, fn=None, *, in_shardings=None, out_shardings=None):
        """Like ``jax.jit``: ``client.jit(f)`` or ``@client.jit(out_shardings=...)``."""
        if fn is None:
            return lambda f: JitFunction(self, f, in_shardings, out_shardings)
        return JitFunction(self, fn, in_shardings, out_shardings)

    def device_put(self, x, sharding, slice: str | int | None = None):
        """Scatter a numpy array (or pytree of them) onto a slice's chips."""
        import jax

        target = self.slice(slice)
        leaves, treedef = jax.tree.flatten(x)
        shardings = jax.tree.leaves(sharding, is_leaf=lambda s: hasattr(s, "spec"))
        if len(shardings) == 1 and len(leaves) > 1:
            shardings = shardings * len(leaves)
        out = []
        for leaf, sh in zip(leaves, shardings, strict=True):
            out.append(self._put_one(np.asarray(leaf), sh, target))
        return jax.tree.unflatten(treedef, out)

    def _put_one(self, x: np.ndarray, sharding, target: SliceInfo) -> RemoteArray:
        import ray

        mesh, spec = _spec_of(sharding, x.ndim)
        if mesh.size != target.chips:
            raise ValueError(f"the mesh {mesh.axis_names}={mesh.axis_sizes} has {mesh.size} "
                             f"devices; slice {target.name} has {target.chips} chips")
        index = shard_slices(x.shape, mesh, spec)
        firsts = unique_shards(index)
        refs = {r: ray.put(np.ascontiguousarray(x[index[r]])) for r in sorted(set(firsts))}
        pieces = [[(refs[firsts[r]], index[firsts[r]])] for r in range(mesh.size)]
        arr = RemoteArray(self, next(self._ids), target.name, x.shape, x.dtype, mesh, spec)
        self._enqueue(target.name, ("put", arr._id, x.shape, x.dtype.name, spec, mesh, pieces))
        return arr

    # ---- running ------------------------------------------------------------------
    def _run(self, program: Program, out_tree, arrays: list[RemoteArray], checked=False):
        target = arrays[0].slice
        if not checked:  # JitFunction matched the signature already; Compiled must check
            program.check_args([a.signature for a in arrays], self._chips[target])
        if program.fingerprint not in self._registered:
            self._controller.register_program.remote(program.fingerprint, program.blob)
            self._registered.add(program.fingerprint)
        outs = [RemoteArray(self, next(self._ids), target, sig.shape, sig.dtype, program.mesh,
                            sig.spec) for sig in program.out_sigs]
        self._enqueue(target, ("run", program.fingerprint, [a._id for a in arrays],
                               [o._id for o in outs]))
        import jax

        return jax.tree.unflatten(out_tree, outs)

    def _enqueue(self, slice_name: str, cmd: tuple) -> None:
        with self._lock:
            if self._groups:
                # A slice and a multislice group that shares its chips feed the same
                # workers: what was issued to one goes out before what follows on the other.
                mine = self._members[slice_name]
                for other, members in self._members.items():
                    if other != slice_name and members & mine and self._pending[other]:
                        self._flush_slice(other)
            pending = self._pending[slice_name]
            pending.append(cmd)
            if len(pending) >= self.max_batch:
                self._flush_slice(slice_name)
            elif len(pending) == 1:
                if time.monotonic() - self._last_flush[slice_name] > self._flush_interval_s:
                    # The start of a burst after a pause: the slice may be idle, so the
                    # first command goes now and the rest are batched behind it.
                    self._flush_slice(slice_name)
                else:
                    self._wake.set()

    def _flush_slice(self, slice_name: str) -> None:
        import ray

        with self._lock:
            batch = self._pending[slice_name]
            if self._frees[slice_name]:
                batch.append(("free", self._frees[slice_name]))
                self._frees[slice_name] = []
            if not batch:
                return
            self._pending[slice_name] = []
            self._last_flush[slice_name] = time.monotonic()
            self._submitted.append(self._controller.submit.remote(slice_name, batch))
            while len(self._submitted) > 32:  # bound what is queued at the controller
                ray.get(self._submitted.popleft(), timeout=600)

    def flush(self) -> None:
        for name in list(self._pending):
            self._flush_slice(name)

    def _flush_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            time.sleep(self._flush_interval_s)  # let a steady stream fill the batch
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - surfaced by the next sync call
                logger.debug("background flush failed", exc_info=True)

    def _free(self, slice_name: str, buffer_id: int) -> None:
        if self._closed:
            return
        with self._lock:
            frees = self._frees.get(slice_name)
            if frees is None:
                return
            frees.append(buffer_id)
            if len(frees) == 1 and not self._pending[slice_name]:
                self._wake.set()

    # ---- results --------------------------------------------------------------------
    def _fetch(self, arr: RemoteArray, timeout_s: float) -> np.ndarray:
        import ray

        self._flush_slice(arr.slice)
        index = shard_slices(arr.shape, arr.mesh, arr.spec)
        firsts = sorted(set(unique_shards(index)))
        refs = ray.get(self._controller.shard_refs.remote(arr.slice, arr._id, firsts),
                       timeout=timeout_s)
        values = _get_remote(refs, timeout_s)
        full = tuple(slice(0, n) for n in arr.shape)
        return assemble(full, arr.dtype.name,
                        [(index[r], v) for r, v in zip(firsts, values, strict=True)])

    def _ready(self, slice_name: str, ids: list[int], timeout_s: float) -> None:
        import ray

        self._flush_slice(slice_name)
        refs = ray.get(self._controller.ready.remote(slice_name, ids), timeout=timeout_s)
        _get_remote(refs, timeout_s)

    def reshard(self, x: RemoteArray, sharding, slice: str | int | None = None,
                *, via_controller: bool = False) -> RemoteArray:
        """``x`` with another sharding, on its slice or on ``slice``.

        Across slices the shards travel worker to worker as object refs;
        ``via_controller=True`` routes the bytes through the controller instead
        (only for measuring the difference)."""
        import ray

        target = self.slice(slice) if slice is not None else self.slice(x.slice)
        mesh, spec = _spec_of(sharding, x.ndim)
        if mesh.size != target.chips:
            raise ValueError(f"the mesh has {mesh.size} devices; slice {target.name} has "
                             f"{target.chips} chips")
        out = RemoteArray(self, next(self._ids), target.name, x.shape, x.dtype, mesh, spec)
        if target.name == x.slice:
            self._enqueue(target.name, ("reshard", x._id, out._id, spec, mesh))
            return out
        self._flush_slice(x.slice)
        self._flush_slice(target.name)
        ray.get(self._controller.transfer.remote(x.slice, x._id, x.shape, x.dtype.name, x.mesh,
                                                 x.spec, target.name, out._id, mesh, spec,
                                                 via_controller),
                timeout=600)
        return out

    def stats(self) -> dict:
        import ray

        self.flush()
        ray.get(self._controller.drain.remote(), timeout=600)
        return ray.get(self._controller.stats.remote(), timeout=600)

    def close(self) -> None:
        import ray

        if self._closed:
            return
        self._closed = True
        self._wake.set()
        try:
            ray.get(self._controller.shutdown.remote(), timeout=120)
        finally:
            ray.kill(self._controller)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _get_remote(refs, timeout_s: float):
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, RemoteError):
            raise RemoteError(cause.command, cause.remote_traceback) from None
        raise


CACHE_ENV = "PATHWAYS_RAY_COMPILATION_CACHE_DIR"


def default_compilation_cache_dir() -> str:
    """``$PATHWAYS_RAY_COMPILATION_CACHE_DIR``, else ``<PATHWAYS_RAY_DIR>/xla-cache``.

    On an emulated fleet every host is this machine, so a local directory is seen by
    all of them; on a real cluster point the variable at shared storage (gs://…, NFS).
    """
    import os

    from pathways_ray.fleet import base_dir

    return os.environ.get(CACHE_ENV) or str(base_dir() / "xla-cache")


def connect(slices: list | None = None, *, reserve_timeout_s: float = 120.0,
            max_batch: int = 64, compilation_cache_dir: str | None = "default",
            multislice: bool = False) -> Client:
    """Start a controller holding ``slices`` (default: every free slice) and return a client.

    The process must be connected to the Ray cluster (a ``LocalFleet``, or
    ``Fleet.attach()``). ``compilation_cache_dir`` is JAX's persistent compilation
    cache on every chip (``None`` turns it off). ``multislice=True`` joins the
    slices' chips in one JAX world, so that a mesh can span slices
    (``client.mesh(..., slices=[0, 1])``, collectives over DCN); each slice still
    runs its own programs too. The joined world is lost with any one slice.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pathways_ray.controller import Controller

    if not ray.is_initialized():
        raise RuntimeError("not connected to a Ray cluster; start a pathways_ray.LocalFleet "
                           "or call pathways_ray.Fleet.attach(address) first")
    specs = None if slices is None else list(slices)  # Topology objects or "v6e-4x4" strings
    # Errors of shards the controller fetched for the client reach the client; the
    # controller need not echo them as "unhandled" when it drops its refs.
    env = {"env_vars": {"RAY_IGNORE_UNHANDLED_ERRORS": "1"}}
    if compilation_cache_dir == "default":
        compilation_cache_dir = default_compilation_cache_dir()
    # The controller runs beside its client (as Ray Train's controller runs beside the
    # driver): off the TPU hosts, whose CPUs and memory belong to the chips, and one
    # local hop from the client that feeds it every step.
    # Hard affinity: with soft=True Ray placed it on a TPU host in 1 of 4 tries here.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0, max_restarts=0, runtime_env=env,
                       scheduling_strategy=here)(Controller).remote(
        specs, reserve_timeout_s, compilation_cache_dir=compilation_cache_dir,
        multislice=multislice)
    return Client(actor, max_batch=max_batch)


def reshard(x: RemoteArray, sharding, slice: str | int | None = None) -> RemoteArray:
    """Move ``x`` to another sharding on its slice, or onto another slice."""
    return x._client.reshard(x, sharding, slice)
