"""``jax.experimental.colocated_python`` through the proxy: the client's Python run on
the TPU host of the devices it was given.

jaxlib's proxy client compiles a colocated function as an IFRT ``CustomCallProgram``
of type ``jax_colocated_python_v0.0.1``: the cloudpickled function with its argument and result
specs, over CPU devices (``colocated_cpu_devices``; on the emulated fleet the chips
are JAX CPU devices, so they are their own colocated devices). The proxy never
unpickles it: it runs ``colocated_host.run_on_host`` in the host's sidecar
(``client.sidecar``), which does, with JAX on that host's CPU devices. Argument
shards go chip -> sidecar through the host's object store and results sidecar ->
chips, as every sidecar call's do; the bytes do not pass through the proxy. The
first call of a function without output specs returns them as a string array (JAX's
own protocol); string results are held here, everything else on the chips.

It runs the client's code on the hosts, so a server runs it only when started to
(``pathways-ray proxy --colocated-python``, ``$PATHWAYS_RAY_PROXY_COLOCATED_PYTHON=1``).
Served: functions and ``colocated_python_class`` objects over the devices of one TPU
host (a v6e 2x2 slice is one); devices of several hosts are refused by name.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from pathways_ray.proxy.arrays import ArrayTable, ProxyArray
from pathways_ray.proxy.errors import InvalidArgument, PermissionDenied, Unimplemented
from pathways_ray.proxy.protos import xla_python_ifrt_custom_call_program_pb2 as custom_pb2
from pathways_ray.proxy.protos import xla_python_ifrt_dtype_pb2 as dtype_pb2
from pathways_ray.proxy.types import ProxySharding, dtype_of, parse_sharding

__all__ = ["COLOCATED_ENV", "ColocatedExecutable", "compile_colocated"]

COLOCATED_ENV = "PATHWAYS_RAY_PROXY_COLOCATED_PYTHON"
COLOCATED_TYPE = "jax_colocated_python"  # JAX's, with its version: "_v0.0.1"
STRING = dtype_pb2.DTypeProto.Kind.Value("KIND_STRING")


@dataclass(frozen=True)
class Spec:
    """One argument or result: its shape, dtype (numpy's ``StringDType`` for strings)
    and sharding as the client gave them."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: ProxySharding


def _spec(proto) -> Spec:
    dtype = (np.dtypes.StringDType() if proto.dtype.kind == STRING
             else dtype_of(proto.dtype))
    return Spec(tuple(int(d) for d in proto.shape.dims), dtype, parse_sharding(proto.sharding))


@dataclass
class ColocatedExecutable:
    name: str
    program: bytes  # cloudpickled by the client; unpickled only on the host
    device_ids: tuple[int, ...]
    ranks: tuple[int, ...]  # each device's chip, by its rank in the slice
    slice_index: int
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]

    def execute(self, table: ArrayTable, args: list[ProxyArray]
                ) -> tuple[list[ProxyArray], Callable[[], None]]:
        """Start the function on its host; its results (at once) and a wait for them."""
        if len(args) != len(self.inputs):
            raise InvalidArgument(f"colocated Python function {self.name} takes "
                                  f"{len(self.inputs)} arrays, was given {len(args)}")
        slices = (self.slice_index,)
        for i, (arr, spec) in enumerate(zip(args, self.inputs, strict=True)):
            if arr.shape != spec.shape or arr.dtype != spec.dtype:
                raise InvalidArgument(f"argument {i} of {self.name} is {arr.dtype}"
                                      f"{list(arr.shape)}; it was compiled for "
                                      f"{spec.dtype}{list(spec.shape)}")
        remotes = [table.on_chips(a, slices) for a in args]
        client = table.client
        run = _on_host(table, table.name(slices), self.name)
        call = (self.program, self.device_ids, self.ranks, *remotes)
        strings = [o.dtype == np.dtypes.StringDType() for o in self.outputs]
        if self.outputs and all(strings):  # JAX's output specs: small, read at once
            got = run(*call).result()
            outs = [ProxyArray(o.shape, o.dtype, table.place(o.sharding, len(o.shape)),
                               o.sharding.device_ids, o.sharding.op, host=np.asarray(v))
                    for o, v in zip(self.outputs, got[0], strict=True)]
            return outs, lambda: None
        if any(strings):
            raise Unimplemented(f"colocated Python function {self.name} returns strings "
                                f"beside other arrays: not served by the pathways-ray proxy")
        from pathways_ray.client.arrays import Layout
        from pathways_ray.client.sidecar import ArrayOut

        placed = [table.place(o.sharding, len(o.shape)) for o in self.outputs]
        outs_spec = [ArrayOut(o.shape, o.dtype, Layout(p.mesh, p.spec))
                     for o, p in zip(self.outputs, placed, strict=True)]
        if not outs_spec:  # nothing returned: done when the host is
            done = run(*call)
            return [], lambda: done.result()
        remote_outs = run.returning(outs_spec)(*call)
        outs = [ProxyArray(o.shape, o.dtype, p, o.sharding.device_ids, o.sharding.op,
                           remote=r)
                for o, p, r in zip(self.outputs, placed, remote_outs, strict=True)]
        return outs, lambda: client.block_until_ready(remote_outs)

    def close(self) -> None:
        pass


# A session's colocated calls on a slice's host run one after another in the order the
# client made them, as programs on the same devices do: a data loader's calls take its
# batches in turn even when none has an argument to order it in the chips' stream. One
# ordered sidecar stream per (session, slice name: a lost slice's replacement has its
# own).
_streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_streams_lock = threading.Lock()


def _on_host(table: ArrayTable, slice_name: str, name: str):
    """The sidecar function that runs program ``name`` on ``slice_name``'s host, after
    the session's colocated calls there before it (its sidecars start on the first)."""
    from pathways_ray.client.sidecar import SidecarFunction, new_object_id
    from pathways_ray.proxy.plugins.colocated_host import run_on_host

    with _streams_lock:
        streams = _streams.setdefault(table, {})
        if slice_name not in streams:
            table.client.sidecar(run_on_host, slice=slice_name)
            streams[slice_name] = new_object_id()
    user = name.removesuffix("_output_specs_and_push_result").removesuffix(
        "_pop_result")  # (JAX's names for a first call's two programs)
    return SidecarFunction(table.client, slice_name, f"colocated_python({user})", "fn",
                           target=run_on_host, obj=streams[slice_name])


def compile_colocated(table: ArrayTable, data: bytes) -> ColocatedExecutable:
    """The program of ``data`` (a ``CustomCallProgramProto``), checked: allowed on this
    server, a colocated Python function, over the devices of one host of the session."""
    if os.environ.get(COLOCATED_ENV, "") not in ("1", "true", "yes"):
        raise PermissionDenied(
            "jax.experimental.colocated_python runs the client's pickled Python on the TPU "
            "hosts, and this server does not allow it: start it with `pathways-ray proxy "
            f"--colocated-python` (${COLOCATED_ENV}=1) where its clients may run code on the "
            "hosts as the server's user")
    try:
        program = custom_pb2.CustomCallProgramProto.FromString(data)
    except DecodeError as e:
        raise InvalidArgument(f"a custom-call program does not parse: {e}") from None
    if not program.type.startswith(COLOCATED_TYPE):
        raise Unimplemented(f"custom-call programs of type {program.type!r} are not served "
                            f"by the pathways-ray proxy (served: {COLOCATED_TYPE}*)")
    ids = tuple(program.devices.device_ids)
    if not ids:
        raise InvalidArgument(f"colocated Python function {program.name} has no devices")
    for d in ids:
        if not 0 <= d < len(table.devices):
            raise InvalidArgument(f"colocated Python function {program.name} names device "
                                  f"{d}; this session has {len(table.devices)} devices")
    devices = [table.devices[d] for d in ids]
    hosts = sorted({(d.slice_name, d.worker_id) for d in devices})
    if len(hosts) > 1:
        raise Unimplemented(
            f"colocated Python function {program.name} is over the devices of "
            f"{len(hosts)} TPU hosts ({', '.join(f'{s}/{w}' for s, w in hosts)}); the "
            f"pathways-ray proxy runs one over one host's devices: call it per host, with "
            f"colocated_cpu_devices of that host's chips")
    name = program.name or "colocated_python"
    inputs = tuple(_spec(s) for s in program.input_specs)
    outputs = tuple(_spec(s) for s in program.output_specs)
    for spec in (*inputs, *outputs):
        if not set(spec.sharding.device_ids) <= set(ids):
            raise InvalidArgument(f"colocated Python function {name}: a spec's sharding "
                                  f"names devices outside the function's {list(ids)}")
    return ColocatedExecutable(name, program.serialized_program_text, ids,
                               tuple(d.rank for d in devices), devices[0].slice_index,
                               inputs, outputs)
