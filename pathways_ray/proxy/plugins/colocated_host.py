"""A ``jax.experimental.colocated_python`` function, run on the TPU host it was sent to.

The proxy sends ``run_on_host`` to the sidecar of the host whose devices the function
was specialized for (``client.sidecar``), with the cloudpickled program jaxlib's
client compiled and the host's shards of its arguments. Here, as in Cloud Pathways'
colocated Python executor, the function meets JAX arrays on this host's CPU devices:
a JAX CPU backend with one device per chip of the host (device ``i``: the host's
``i``-th chip), the program's device ids mapped onto them while it is unpickled (the
ids the client knows are the proxy's). What it returns is read back as numpy, this
host's block of each result, which the sidecar cuts into its chips' shards.

State lives as the sidecar does: JAX's own result store (a first call computes its
output specs and keeps the result for the call that pops it) and the objects of
``colocated_python_class`` stay in this process between calls. No Ray here.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

__all__ = ["run_on_host"]

_UNPICKLE = threading.RLock()  # JAX's device lookups by id, mapped for one call at a time
_PROGRAMS = 64  # unpickled programs kept per host (least recently used go)


def _cpu_jax(chips: int):
    """JAX with (at least) one CPU device per chip of this host."""
    import jax

    try:  # before JAX's first use in this process; later it is as it is
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", chips)
    except RuntimeError:
        pass
    have = len(jax.local_devices(backend="cpu"))
    if have < chips:
        raise RuntimeError(f"this host's sidecar has {have} JAX CPU devices for {chips} chips "
                           f"(JAX was started in it before with fewer): colocated Python "
                           f"needs one per chip")
    return jax


def _program(state: dict, program: bytes, by_id: dict):
    """``(fun, in_treedef, in_specs, out_treedef, out_specs, devices)``, unpickled with
    the proxy's device ids as this host's CPU devices (kept for the next call)."""
    from jax.experimental.colocated_python import serialization

    cache: OrderedDict = state.setdefault("colocated_programs", OrderedDict())
    key = (hashlib.sha256(program).digest(), tuple(sorted(by_id)))
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    with _UNPICKLE:  # one mapping at a time: JAX looks devices up by id while unpickling
        own = serialization._get_cpu_device_map
        serialization._get_cpu_device_map = lambda: by_id
        try:
            value = serialization._deserialize(program)
        finally:
            serialization._get_cpu_device_map = own
    cache[key] = value
    while len(cache) > _PROGRAMS:
        cache.popitem(last=False)
    return value


@contextmanager
def _as_proxy_ids(to_proxy: dict[int, int]):
    """While JAX pickles on this host (a first call's output specs go back to the
    client), devices are written with the ids the client knows, not this host's own:
    JAX's reducers, with the ids mapped (its unpicklers read them on the client)."""
    from jax.experimental.colocated_python import serialization as ser

    def ids(devices):
        return np.vectorize(lambda d: to_proxy[d.id], otypes=[int])(devices)

    mesh = ser._make_reduce_func_with_common_obj(
        lambda m: (ser._unreduce_mesh, (ids(m.devices), m.axis_names, m.axis_types)))
    reducers = {
        "_reduce_mesh": mesh,
        "_reduce_named_sharding": ser._make_reduce_func_with_common_obj(
            lambda s: (ser._unreduce_named_sharding, (mesh(s.mesh), s.spec, s.memory_kind))),
        "_reduce_device_list": ser._make_reduce_func_with_common_obj(
            lambda dl: (ser._unreduce_device_list, (ids(list(dl)).tolist(),))),
        "_reduce_single_device_sharding": ser._make_reduce_func_with_common_obj(
            lambda s: (ser._unreduce_single_device_sharding,
                       (to_proxy[next(iter(s.device_set)).id], s.memory_kind))),
    }
    with _UNPICKLE:
        own = {k: getattr(ser, k) for k in reducers}
        for k, v in reducers.items():
            setattr(ser, k, v)
        try:
            yield
        finally:
            for k, v in own.items():
                setattr(ser, k, v)


def _array(jax, spec, arg, i: int):
    """The JAX array of argument ``i`` on this host's CPU devices, from its shards."""
    if tuple(arg.shape) != tuple(spec.shape) or np.dtype(arg.dtype) != np.dtype(spec.dtype):
        raise ValueError(f"argument {i} is {arg.dtype}{list(arg.shape)}; the function was "
                         f"specialized for {np.dtype(spec.dtype)}{list(spec.shape)}")
    full = np.empty(arg.shape, arg.dtype)
    for index, block in arg.shards:  # (this host holds every block of it)
        full[index] = block
    return jax.make_array_from_callback(tuple(arg.shape), spec.sharding, lambda i: full[i])


def run_on_host(host, program: bytes, device_ids: tuple[int, ...], ranks: tuple[int, ...],
                *arrays):
    """Run the program on this host (``host``: the sidecar's ``Host``); ``device_ids``
    are the program's devices, ``ranks`` their chips' ranks in the slice. Returns this
    host's block of each result, in the order of the program's output specs."""
    jax = _cpu_jax(len(host.chips))
    local = jax.local_devices(backend="cpu")
    by_id = {d: local[host.chips.index(r)] for d, r in zip(device_ids, ranks, strict=True)}
    fun, in_treedef, in_specs, _out_treedef, out_specs, _devices = _program(
        host.state, program, by_id)
    if len(arrays) != len(in_specs):
        raise ValueError(f"{len(arrays)} arguments for a function specialized for "
                         f"{len(in_specs)}")
    leaves = [_array(jax, s, a, i) for i, (s, a) in enumerate(zip(in_specs, arrays, strict=True))]
    args, kwargs = jax.tree.unflatten(in_treedef, leaves)
    if any(isinstance(np.dtype(s.dtype), np.dtypes.StringDType) for s in out_specs):
        # JAX's first call: its result is the output specs, pickled here
        with _as_proxy_ids({d.id: i for i, d in by_id.items()}):
            out = jax.tree.leaves(fun(*args, **kwargs))
    else:
        out = jax.tree.leaves(fun(*args, **kwargs))
    if len(out) != len(out_specs):
        raise ValueError(f"the function returned {len(out)} arrays; its output specs "
                         f"say {len(out_specs)}")
    blocks = []
    for i, (x, spec) in enumerate(zip(out, out_specs, strict=True)):
        block = np.asarray(x)
        if block.shape != tuple(spec.shape) or block.dtype != np.dtype(spec.dtype):
            raise ValueError(f"result {i} is {block.dtype}{list(block.shape)}; its output "
                             f"spec says {np.dtype(spec.dtype)}{list(spec.shape)}")
        blocks.append(block)
    return tuple(blocks)
