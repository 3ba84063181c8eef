"""A session's program requests (a mixin of ``session.Session``): compile, metadata,
execute and its status, destruct; and the defaults JAX asks a backend for (device
assignment, layout)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pathways_ray.errors import SliceLost
from pathways_ray.proxy import programs
from pathways_ray.proxy.arrays import ProxyArray
from pathways_ray.proxy.errors import (
    DATA_LOSS,
    UNIMPLEMENTED,
    InvalidArgument,
    NotFound,
    Unimplemented,
)
from pathways_ray.proxy.host_buffers import MAX_ELEMENTS
from pathways_ray.proxy.plugins.colocated import ColocatedExecutable, compile_colocated
from pathways_ray.proxy.plugins.run import PluginExecutable, compile_plugin
from pathways_ray.proxy.types import dtype_of

__all__ = ["ProgramRequests"]


def _raiser(e: BaseException) -> Callable[[], None]:
    def wait() -> None:
        raise e

    return wait


class ProgramRequests:
    """Mixin of ``Session``: its ``executables`` and the requests about them."""

    def _compile(self, req, response) -> None:
        if req.host_callbacks:
            raise Unimplemented("programs with host callbacks (jax.debug.print, "
                                      "pure_callback) are not served by the pathways-ray proxy")
        kind = req.program.type_name
        if kind == "xla::ifrt::PluginProgram":
            exe = compile_plugin(self.arrays, req.program.data)
            name, fingerprint = exe.name, f"plugin-{next(self._handles)}"
        elif kind in ("", "xla::ifrt::XlaProgram"):
            exe = programs.compile_program(self.arrays, self.parser, req.program.data,
                                           req.compile_options.data, self._timeout_s)
            name, fingerprint = exe.program.fun_name, exe.program.fingerprint
        elif kind == "xla::ifrt::CustomCallProgram":  # jax.experimental.colocated_python
            exe = compile_colocated(self.arrays, req.program.data)
            name, fingerprint = exe.name, f"colocated-{next(self._handles)}"
        else:
            raise Unimplemented(f"IFRT programs of type {kind!r} are not served by the "
                                f"pathways-ray proxy (served: XlaProgram, PluginProgram)")
        handle = next(self._handles)
        self.executables[handle] = exe
        ready = next(self._handles)
        self._futures[ready] = lambda: None
        out = response.compile_response
        out.loaded_executable_handle = handle
        out.name = name
        out.num_devices = len(exe.device_ids)
        out.device_ids.extend(exe.device_ids)
        out.addressable_device_ids.extend(exe.device_ids)
        out.fingerprint_value = fingerprint.encode()
        out.ready_future_handle = ready

    def _executable(self, handle: int
                    ) -> programs.Executable | PluginExecutable | ColocatedExecutable:
        if handle not in self.executables:
            raise NotFound(f"unknown loaded executable handle {handle}")
        return self.executables[handle]

    def _loaded_executable_metadata(self, req, response) -> None:
        from pathways_ray.proxy.protos import xla_xla_data_pb2

        exe = self._executable(req.loaded_executable_handle)
        out = response.loaded_executable_metadata_response
        if isinstance(exe, (PluginExecutable, ColocatedExecutable)):  # no XLA program
            for status in (out.parameter_layouts_error, out.output_layouts_error,
                           out.donated_input_indices_error, out.compiled_memory_stats_error,
                           out.output_memory_kinds.status):
                status.code = UNIMPLEMENTED
                status.message = f"{exe.name} is not an XLA program: it has no XLA metadata"
            return
        if exe.signature is not None:
            for ops, into in ((exe.signature.in_shardings, out.parameter_shardings),
                              (exe.signature.out_shardings, out.output_shardings)):
                into.SetInParent()
                into.shardings.extend(xla_xla_data_pb2.OpSharding.FromString(b) for b in ops)
            # One list for the program, a kind per result.
            out.output_memory_kinds.memory_kind_lists.add().memory_kinds.extend(
                exe.signature.out_memory)
        else:  # lost before it compiled: JAX then keeps the shardings it asked for
            out.output_memory_kinds.status.code = DATA_LOSS
            out.output_memory_kinds.status.message = str(exe.lost)
        unsaid = ["parameter_layouts_error", "output_layouts_error",
                  "donated_input_indices_error"]
        stats = exe.signature.memory_stats if exe.signature is not None else None
        if stats:  # what one chip's executable needs, as jax's memory_analysis() says it
            fields = out.compiled_memory_stats.DESCRIPTOR.fields_by_name
            for k, v in stats.items():
                if k in fields:
                    setattr(out.compiled_memory_stats, k, v)
            out.size_of_generated_code_in_bytes = stats.get("generated_code_size_in_bytes", 0)
        else:
            unsaid.append("compiled_memory_stats_error")
        for field in unsaid:
            getattr(out, field).code = UNIMPLEMENTED
            getattr(out, field).message = "not reported by the pathways-ray proxy"

    def _loaded_executable_execute(self, req, response) -> None:
        """Results are handles at once; a run on a lost slice answers with results that
        hold ``DATA_LOSS`` (as its status does), raised where the client reads them."""
        exe = self._executable(req.loaded_executable_handle)
        args = [self.arrays.entry(h) for h in req.args_handles]
        if isinstance(exe, (PluginExecutable, ColocatedExecutable)):
            return self._execute_plugin(exe, req, args, response)
        n_out = len(exe.hlo.out_shapes)
        if req.result_array_handle and len(req.result_array_handle) != n_out:
            raise InvalidArgument(f"{len(req.result_array_handle)} result handles for a "
                                  f"program of {n_out} results")
        failed = next((a for a in args if isinstance(a, BaseException)), None)
        try:
            if failed is not None:  # an input's error is its results' (as IFRT's futures)
                raise failed
            outs: list = programs.execute(self.arrays, exe, args)
        except SliceLost as e:
            outs = [e] * len(exe.hlo.out_shapes)
        handles = [h or next(self._handles)
                   for h in (list(req.result_array_handle) or [0] * len(outs))]
        for h, a in zip(handles, outs, strict=True):
            self.arrays.set(h, a)
        out = response.loaded_executable_execute_response
        out.SetInParent()
        if req.execute_options.fill_status:
            status = req.result_status_handle or next(self._handles)
            arrays = [a for a in outs if isinstance(a, ProxyArray)]
            failed = next((a for a in outs if isinstance(a, BaseException)), None)
            self._futures[status] = (
                (lambda: self.arrays.ready(arrays, self._timeout_s)) if failed is None
                else _raiser(failed))
            out.status_handle = status
        if not req.result_array_handle:
            from pathways_ray.proxy.types import dtype_proto, hlo_sharding_proto

            kinds = (exe.signature.out_memory if exe.signature is not None
                     else ["device"] * len(handles))
            for i, (h, (shape, dtype), kind) in enumerate(zip(handles, exe.hlo.out_shapes,
                                                              kinds, strict=True)):
                o = out.outputs.add(array_handle=h)
                o.dtype.CopyFrom(dtype_proto(dtype))
                o.shape.dims.extend(shape)
                op = (None if exe.single or exe.signature is None
                      else exe.signature.out_shardings[i])
                o.sharding.CopyFrom(hlo_sharding_proto(exe.device_ids, op, kind))

    def _execute_plugin(self, exe: PluginExecutable | ColocatedExecutable, req, args,
                        response) -> None:
        failed = next((a for a in args if isinstance(a, BaseException)), None)
        if failed is not None:
            raise failed
        outs, wait = exe.execute(self.arrays, args)
        if req.result_array_handle and len(req.result_array_handle) != len(outs):
            raise InvalidArgument(f"{len(req.result_array_handle)} result handles for a "
                                  f"plugin program of {len(outs)} results")
        handles = list(req.result_array_handle) or [next(self._handles) for _ in outs]
        for h, a in zip(handles, outs, strict=True):
            self.arrays.set(h, a)
        out = response.loaded_executable_execute_response
        out.SetInParent()
        if req.execute_options.fill_status:  # (else jaxlib's client wants none)
            status = req.result_status_handle or next(self._handles)
            self._futures[status] = wait
            out.status_handle = status
        if not req.result_array_handle:
            from pathways_ray.proxy.types import dtype_proto, hlo_sharding_proto

            for h, a in zip(handles, outs, strict=True):
                o = out.outputs.add(array_handle=h)
                o.dtype.CopyFrom(dtype_proto(a.dtype))
                o.shape.dims.extend(a.shape)
                o.sharding.CopyFrom(hlo_sharding_proto(
                    a.device_ids, a.op.SerializeToString() if a.op is not None else None,
                    a.memory))

    def _loaded_executable_fetch_execute_result(self, req, response, wait) -> None:
        wait()
        response.loaded_executable_fetch_execute_result_response.SetInParent()

    def _loaded_executable_destruct(self, req, response) -> None:
        exe = self._executable(req.loaded_executable_handle)
        del self.executables[req.loaded_executable_handle]
        if isinstance(exe, (PluginExecutable, ColocatedExecutable)):
            exe.close()
        response.loaded_executable_destruct_response.SetInParent()

    def _close_executables(self) -> None:
        """Forget every executable; a plugin program still running (a profile) stops."""
        for exe in self.executables.values():
            if isinstance(exe, PluginExecutable):
                exe.close()
        self.executables.clear()

    def _get_default_layout(self, req, response) -> None:
        """The layout JAX's CPU devices give an array by default (the emulated chips are
        JAX CPU devices); TPU layouts are the chips' own and not reported here."""
        if not 0 <= req.device_id < len(self.devices):
            raise InvalidArgument(f"device {req.device_id} is not one of this session's "
                                  f"{len(self.devices)} devices")
        if self.devices[req.device_id].platform != "cpu":
            raise Unimplemented("default layouts of TPU devices are not reported by the "
                                "pathways-ray proxy")
        if (any(not 0 <= d <= MAX_ELEMENTS for d in req.dims) or len(req.dims) > 64
                or int(np.prod([float(d) for d in req.dims])) > MAX_ELEMENTS):
            raise InvalidArgument(f"a default layout of shape {list(req.dims)[:8]}: a "
                                  f"dimension is negative, or the shape too large")
        import jax

        cpu = jax.devices("cpu")[0]
        layout = cpu.client.get_default_layout(dtype_of(req.dtype), tuple(req.dims), cpu)
        response.get_default_layout_response.serialized_pjrt_layout = layout.__getstate__()[0]

    def _get_default_device_assignment(self, req, response) -> None:
        n = req.num_replicas * req.num_partitions
        if req.num_replicas < 1 or req.num_partitions < 1 or n > len(self.devices):
            raise InvalidArgument(f"{req.num_replicas} replicas x {req.num_partitions} "
                                  f"partitions: this session has {len(self.devices)} devices")
        out = response.get_default_device_assignment_response.device_assignment
        out.replica_count, out.computation_count = req.num_replicas, req.num_partitions
        for p in range(req.num_partitions):
            out.computation_devices.add().replica_device_ids.extend(
                r * req.num_partitions + p for r in range(req.num_replicas))
