"""One ``IfrtSession``: one client's world, its requests answered in order.

On its ``InitRequest`` the session connects a ``Client`` of its own
(``pathways_ray.connect``: its own controller, arrays, programs and slices, reserved
from the fleet or leased from a shared service) and answers with one device per
chip. Then it serves arrays (``arrays.ArrayTable``) and programs (``programs``).

Requests are handled in the order they come; the ones that wait for the chips
(ready checks, fetches, a program's status) answer when done, so later requests
go on meanwhile, as jaxlib's own server does. Every failure is an error status on
its response (and on the array handles the request would have made): a lost slice
is ``DATA_LOSS`` naming the slice and its hosts; the session stays up.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent import futures

import numpy as np

from pathways_ray.clusters.cluster import slice_order
from pathways_ray.clusters.topology import Topology
from pathways_ray.errors import PathwaysError, SliceLost
from pathways_ray.proxy import programs
from pathways_ray.proxy.arrays import ArrayTable, ProxyArray
from pathways_ray.proxy.devices import ProxyDevice, init_response, plan_devices
from pathways_ray.proxy.errors import (
    INTERNAL,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ProxyStatus,
    Status,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    status_of,
)
from pathways_ray.proxy.host_buffers import HostBuffers, host_array
from pathways_ray.proxy.program_parser import ProgramParser
from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2
from pathways_ray.proxy.session_programs import ProgramRequests
from pathways_ray.proxy.types import dtype_of, parse_sharding, served_memory

__all__ = ["Session"]

logger = logging.getLogger(__name__)

SERVER_HANDLES = 1 << 62  # above the client's own handles
WAITS = {"check_value_ready_request", "check_future_request", "copy_to_host_buffer_request",
         "loaded_executable_fetch_execute_result_request"}


def _pairs(a, b, what: str) -> zip:
    """``zip(a, b)`` of two lists the client gave, which must be as long as each other."""
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise InvalidArgument(f"{what}: {len(a)} and {len(b)} are not the same number")
    return zip(a, b, strict=True)


class Session(ProgramRequests):
    """One client's world. ``id`` is the secret the host-buffer calls name the session
    by (never logged); ``number`` is how logs and thread names call it."""

    _numbers = itertools.count(1)

    def __init__(self, session_id: int, version: int, connect: Callable[[], object],
                 fetch_timeout_s: float | None = None, refused: str | None = None,
                 parser: ProgramParser | None = None, host_buffer_timeout_s: float = 300.0,
                 release: Callable[..., None] | None = None):
        self.id = session_id
        # What becomes of the client when the session ends (a server's warm pool may
        # keep it for the next session: ``release(client, healthy=...)``); else closed.
        self._release = release or (lambda client, healthy: client.close())
        # Reads the client's programs out of this process (a server shares one).
        self._own_parser = parser is None
        self.parser = parser or ProgramParser()
        self.number = next(Session._numbers)
        self.refused = refused  # why every request is answered UNAUTHENTICATED
        self.version = version
        self._connect = connect
        self.client = None
        self.devices: list[ProxyDevice] = []
        self.host_buffers = HostBuffers(host_buffer_timeout_s)
        self.arrays: ArrayTable | None = None
        self.executables: dict[int, programs.Executable] = {}
        self._futures: dict[int, Callable[[], None]] = {}
        self._handles = itertools.count(SERVER_HANDLES)
        self._closed = False
        self._closing = threading.Lock()  # one close() at a time
        self._init_lock = threading.Lock()  # held while InitRequest connects the client
        self._waits = futures.ThreadPoolExecutor(
            4, thread_name_prefix=f"proxy-session-{self.number}")
        self._timeout_s = fetch_timeout_s
        # Bytes that passed through the proxy: from the client's host buffers, back to
        # it, and between this process and the chips (the session's Client's counters).
        self._counts_lock = threading.Lock()
        self._client_base: dict[str, int] = {}
        self.counters = {"host_bytes_in": 0, "host_bytes_out": 0, "put_bytes": 0,
                         "fetched_bytes": 0, "fetches": 0}

    def count(self, key: str, n: int) -> None:
        with self._counts_lock:
            self.counters[key] += n

    def stats(self) -> dict[str, int]:
        client = self.client  # close() may clear it meanwhile
        with self._counts_lock:
            if client is not None:
                # (A client handed on from an earlier session counted its bytes too.)
                self.counters.update({k: client.counters[k] - self._client_base.get(k, 0)
                                      for k in ("put_bytes", "fetched_bytes", "fetches")})
            return dict(self.counters)

    # ---- requests --------------------------------------------------------------------
    def submit(self, request: ifrt_pb2.IfrtRequest, respond: Callable) -> futures.Future | None:
        """Handle ``request``: at once, or (a wait) on the session's threads; either way
        ``respond(response)`` is called once."""
        kind = request.WhichOneof("request")
        prepared = None
        if kind in WAITS and self.arrays is not None:
            prepared = self._prepare_wait(request, kind)
            try:
                return self._waits.submit(lambda: respond(self._run(request, kind, prepared)))
            except RuntimeError:  # the session closed meanwhile: answered at once
                prepared = FailedPrecondition("the session is closed")
        respond(self._run(request, kind, prepared))
        return None

    def handle(self, request: ifrt_pb2.IfrtRequest) -> ifrt_pb2.IfrtResponse:
        """Handle one request and wait for its answer (tests, and the stream's waits)."""
        out = []
        f = self.submit(request, out.append)
        if f is not None:
            f.result()
        return out[0]

    def _prepare_wait(self, request, kind):
        """What a wait needs from the tables, taken now (in request order)."""
        try:
            if kind == "check_value_ready_request":
                return [self.arrays.get(h) for h in request.check_value_ready_request.value_handles]
            if kind == "copy_to_host_buffer_request":
                return self.arrays.get(request.copy_to_host_buffer_request.array_handle)
            handle = (request.check_future_request.future_handle if kind == "check_future_request"
                      else request.loaded_executable_fetch_execute_result_request
                      .result_status_handle)
            if handle not in self._futures:
                raise NotFound(f"unknown future handle {handle}")
            return self._futures.pop(handle)
        except BaseException as e:  # noqa: BLE001 - answered as the request's error
            return e

    def _run(self, request, kind, prepared=None) -> ifrt_pb2.IfrtResponse:
        response = ifrt_pb2.IfrtResponse()
        response.response_metadata.op_id = request.request_metadata.op_id
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("session %d <- %s", self.number, kind)
        try:
            if self.refused is not None:
                raise Unauthenticated(self.refused)
            if isinstance(prepared, BaseException):
                raise prepared
            if kind is None:
                raise InvalidArgument("a request of no kind this server knows (an empty "
                                      "IfrtRequest, or one from a newer protocol)")
            if kind != "init_request" and self.arrays is None:
                raise FailedPrecondition(f"{kind} before the session's InitRequest")
            handler = getattr(self, "_" + kind.removesuffix("_request"), None)
            if handler is None:
                raise Unimplemented(f"pathways-ray's IFRT proxy does not serve {kind}")
            if prepared is not None:
                handler(getattr(request, kind), response, prepared)
            else:
                handler(getattr(request, kind), response)
        except BaseException as e:  # noqa: BLE001 - the client must get the error, not a cut
            news = isinstance(e, SliceLost) and self.arrays is not None and (
                self.arrays.note_lost(e))  # (said once per lost slice, not per read)
            code, message = status_of(e, kind or "a request")
            log = logger.warning if code == INTERNAL or news else logger.info
            log("session %d: %s failed: %s", self.number, kind, message.splitlines()[0])
            # Its results hold the error: a lost slice as it is, anything else as the
            # status decided now (an internal error is one incident, however often read).
            self._fail_handles(request, kind, e if isinstance(e, (ProxyStatus, SliceLost))
                               else Status(code, message))
            response.ClearField("response")
            response.response_metadata.status.code = code
            response.response_metadata.status.message = message
        return response

    def _fail_handles(self, request, kind, e) -> None:
        """The handles the client made for this request's results hold its error."""
        if self.arrays is None or kind is None:
            return
        body = getattr(request, kind)
        for name in ("array_handle", "array_handles", "result_handle", "result_handles",
                     "result_array_handle"):
            if name in ("array_handle", "array_handles") and not kind.startswith("make_"):
                continue
            if hasattr(body, name):
                value = getattr(body, name)
                for h in (value if not isinstance(value, int) else [value]):
                    if h:
                        try:
                            self.arrays.set(h, e)
                        except InvalidArgument:  # in use: it keeps its array
                            pass

    def _new(self, handle: int, arr: ProxyArray) -> int:
        handle = handle or next(self._handles)
        self.arrays.set(handle, arr)
        return handle

    # ---- session ---------------------------------------------------------------------
    def _init(self, req, response) -> None:
        with self._init_lock:  # close() waits for a client being connected, then closes it
            if self._closed:
                raise FailedPrecondition("the session closed before it was initialized")
            if self.client is None:
                try:
                    client = self._connect()
                    self._client_base = dict(client.counters)
                    self.client = client
                except (ProxyStatus, PathwaysError):
                    raise
                except Exception as e:  # noqa: BLE001 - the platform says why it cannot
                    raise Unavailable(f"the session's slices could not be had: {e}") from e
                slices = sorted(({**d, "topology": Topology.of(d["topology"])}
                                 for d in self.client.describe()),
                                key=lambda d: slice_order(d["name"]))
                self.devices = plan_devices(slices)
                joint = len(slices) > 1 and all(d.get("joint") for d in slices)
                self.arrays = ArrayTable(self.client, self.devices, slices, joint=joint)
                logger.info("session %d: %d devices on %s", self.number, len(self.devices),
                            ", ".join(d["name"] for d in slices))
        response.init_response.CopyFrom(init_response(self.id, self.devices))

    def close(self) -> None:
        """Close the session's client (its controller, its slices); idempotent, and a
        second caller waits until the first has finished. A client still being
        connected by ``InitRequest`` is waited for and closed too: nothing it reserved
        outlives the session."""
        with self._closing:
            self._closed = True
            if self._own_parser:
                self.parser.close()
            self.host_buffers.close()
            self._waits.shutdown(wait=False, cancel_futures=True)
            with self._init_lock:
                healthy = self.arrays is not None and not self.arrays.lost
                if self.arrays is not None:
                    self.arrays.clear()  # the session's arrays are freed on the chips
                self._close_executables()
                self._futures.clear()
                if self.client is not None:
                    self.stats()  # the last counts, kept past the client
                    try:
                        self._release(self.client, healthy=healthy)
                    finally:
                        self.client = None

    # ---- arrays ----------------------------------------------------------------------
    def _host_array(self, handle: int, dtype_proto, shape_proto, strides) -> np.ndarray:
        """The array a host buffer holds, read within the buffer's bytes only."""
        dtype, shape = dtype_of(dtype_proto), tuple(shape_proto.dims)
        try:
            data = self.host_buffers.take(handle)
        except TimeoutError as e:
            raise NotFound(str(e)) from None
        given = list(strides.strides) if strides is not None else []
        return host_array(data, dtype, shape, given or None)  # none given: dense

    def _make_array_from_host_buffer(self, req, response) -> None:
        data = self._host_array(req.host_buffer_handle, req.dtype, req.shape,
                                req.byte_strides if req.HasField("byte_strides") else None)
        arr = self.arrays.from_host(data, parse_sharding(req.sharding))
        response.make_array_from_host_buffer_response.array_handle = self._new(
            req.array_handle, arr)

    def _make_arrays_from_host_buffer_shards(self, req, response) -> None:
        out = response.make_arrays_from_host_buffer_shards_response
        handles = list(req.array_handles) or [0] * len(req.specs)
        for spec, handle in _pairs(req.specs, handles, "specs and array handles"):
            sharding = parse_sharding(spec.array_spec.sharding)
            shape, dtype = tuple(spec.array_spec.shape.dims), dtype_of(spec.array_spec.dtype)
            parts: dict[int, np.ndarray] = {}
            for indices, hb in _pairs(spec.addressable_shard_indices, spec.host_buffers,
                                      "shard index lists and host buffers"):
                data = self._host_array(hb.host_buffer_handle, hb.dtype, hb.shape,
                                        hb.byte_strides if hb.HasField("byte_strides") else None)
                for i in indices.indices:
                    if not 0 <= i < len(sharding.device_ids):
                        raise InvalidArgument(f"shard index {i} of a sharding over "
                                              f"{len(sharding.device_ids)} devices")
                    parts[i] = data
            missing = [i for i in range(len(sharding.device_ids)) if i not in parts]
            if missing:
                raise InvalidArgument(f"no host buffer for the shards {missing[:8]} of a "
                                      f"sharding over {len(sharding.device_ids)} devices")
            one = [ProxyArray(parts[i].shape, parts[i].dtype, None, (d,), host=parts[i])
                   for i, d in enumerate(sharding.device_ids)]
            arr = self.arrays.assemble(one, shape, dtype, sharding)
            out.array_handles.append(self._new(handle, arr))

    def _assemble_array_from_single_device_arrays(self, req, response) -> None:
        parts = [self.arrays.get(h) for h in req.single_device_array_handles]
        if not parts:
            raise InvalidArgument("an array assembled from no single-device arrays")
        arr = self.arrays.assemble(parts, tuple(req.shape.dims), dtype_of(req.dtype)
                                   if req.HasField("dtype") else parts[0].dtype,
                                   parse_sharding(req.sharding))
        response.assemble_array_from_single_device_arrays_response.array_handle = self._new(
            req.result_handle, arr)

    def _disassemble_into_single_device_arrays(self, req, response) -> None:
        parts = self.arrays.disassemble(self.arrays.get(req.array_handle))
        handles = list(req.result_handles) or [0] * len(parts)
        response.disassemble_into_single_device_arrays_response.array_handles.extend(
            self._new(h, p) for h, p in _pairs(handles, parts, "result handles and shards"))

    def _fully_replicated_shard(self, req, response) -> None:
        one = self.arrays.fully_replicated_shard(self.arrays.get(req.array_handle))
        response.fully_replicated_shard_response.array_handle = self._new(req.result_handle, one)

    def _copy_arrays(self, req, response) -> None:
        arrays = [self.arrays.get(h) for h in req.array_handles]
        handles = list(req.result_handles) or [0] * len(arrays)
        kind = served_memory(req.memory_kind)
        out = [self.arrays.copy(a, tuple(req.device_ids) or a.device_ids, kind)
               if req.device_ids or kind else a for a in arrays]
        response.copy_arrays_response.array_handles.extend(
            self._new(h, a) for h, a in _pairs(handles, out, "result handles and arrays"))

    def _reshard_arrays(self, req, response) -> None:
        arrays = [self.arrays.get(h) for h in req.array_handles]
        handles = list(req.result_handles) or [0] * len(arrays)
        out = [self.arrays.reshard(a, parse_sharding(spec.sharding))
               for a, spec in _pairs(arrays, req.array_specs, "arrays and array specs")]
        response.reshard_arrays_response.array_handles.extend(
            self._new(h, a) for h, a in _pairs(handles, out, "result handles and arrays"))

    def _copy_to_host_buffer(self, req, response, arr: ProxyArray) -> None:
        value = self.arrays.to_host(arr, self._timeout_s)
        if isinstance(value.dtype, np.dtypes.StringDType):  # as IFRT's proxy sends strings
            from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_array_util_pb2

            data = xla_python_ifrt_proxy_common_array_util_pb2.StringArrayContents(
                strings=[str(s).encode() for s in value.ravel()]).SerializeToString()
        else:
            data = np.ascontiguousarray(value).tobytes()
        try:
            self.host_buffers.store(req.host_buffer_handle, data)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        self.count("host_bytes_out", len(data))
        response.copy_to_host_buffer_response.SetInParent()

    def _check_value_ready(self, req, response, arrays: list[ProxyArray]) -> None:
        self.arrays.ready(arrays, self._timeout_s)
        response.check_value_ready_response.SetInParent()

    def _delete_array(self, req, response) -> None:
        for h in req.array_handle:
            self.arrays.entry(h)  # NotFound before any is deleted
        for h in req.array_handle:
            self.arrays.delete(h)
        handle = next(self._handles)
        self._futures[handle] = lambda: None
        response.delete_array_response.deletion_future_handle = handle

    def _is_array_deleted(self, req, response) -> None:
        response.is_array_deleted_response.deleted = self.arrays.is_deleted(req.array_handle)

    def _destruct_array(self, req, response) -> None:
        missing = [h for h in req.array_handle if not self.arrays.pop(h)]
        if missing:
            raise NotFound(f"unknown array handles {missing}")
        response.destruct_array_response.SetInParent()

    def _check_future(self, req, response, wait: Callable[[], None]) -> None:
        wait()
        response.check_future_response.SetInParent()
