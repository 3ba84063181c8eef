"""``ProxyServer``: jaxlib's IFRT proxy protocol (``GrpcIfrtService``), served in front
of the single controller.

Every ``IfrtSession`` stream is one client's world: on its ``InitRequest`` the
session connects a ``Client`` of its own (``pathways_ray.connect``: its own
controller, arrays, programs and slices, reserved from the fleet or leased from a
shared service) and answers with one device per chip (``devices.plan_devices``).
When the stream ends, the session's client closes and its slices go back.

What is served so far: version negotiation, sessions and devices
(``jax.devices()``, ``slice_index``, meshes over them). Every other request is
answered with an ``UNIMPLEMENTED`` status that names it, which JAX raises as a
``JaxRuntimeError`` on the client: nothing hangs, and the session stays up.

Security: the server listens on 127.0.0.1 unless given another host. The gRPC is
plain (``IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS=true`` on the client; jaxlib reads
"true" only: "1" still asks for ALTS): keep it on
loopback, or behind the cluster's own network controls (a Kubernetes
NetworkPolicy, a private VPC).
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import grpc

from pathways_ray.clusters.topology import Topology
from pathways_ray.proxy import versions
from pathways_ray.proxy.devices import ProxyDevice, plan_devices
from pathways_ray.proxy.protos import xla_python_ifrt_attribute_map_pb2 as attribute_map_pb2
from pathways_ray.proxy.protos import (
    xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2 as grpc_pb2,
)
from pathways_ray.proxy.protos import (
    xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2_grpc as grpc_service,
)
from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2

__all__ = ["ProxyServer"]

logger = logging.getLogger(__name__)

SESSION_METADATA = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
UNIMPLEMENTED, INTERNAL, FAILED_PRECONDITION = 12, 13, 9  # tensorflow.error.Code


def _attributes(values: dict) -> attribute_map_pb2.AttributeMapProto:
    out = attribute_map_pb2.AttributeMapProto()
    for key, value in values.items():
        v = out.attributes[key]
        if isinstance(value, str):
            v.string_value = value.encode()
        elif isinstance(value, bool):
            v.bool_value = value
        elif isinstance(value, int):
            v.int64_value = value
        else:
            v.int64_list_value.elements.extend(value)
    return out


def init_response(session_id: int, devices: Sequence[ProxyDevice]) -> ifrt_pb2.InitResponse:
    """The session's devices, each with one memory, all addressable by the client."""
    platform = devices[0].platform if devices else "cpu"
    resp = ifrt_pb2.InitResponse(
        session_id=session_id, platform_name=platform, platform_version="pathways-ray",
        platform_id=0, process_index=0, runtime_type="pathways-ray")
    for d in devices:
        resp.all_devices.append(ifrt_pb2.InitResponse.Device(
            id=d.id, local_device_id=d.id, local_hardware_id=d.rank, platform_name=d.platform,
            device_kind=d.device_kind, default_memory_id=d.id, memory_ids=[d.id],
            debug_string=d.describe(), to_string=d.describe(),
            attributes=_attributes({"slice_index": d.slice_index, "coords": list(d.coords),
                                    "core_on_chip": 0, "worker_id": d.worker_id,
                                    "slice_name": d.slice_name})))
        resp.memories.append(ifrt_pb2.InitResponse.Memory(
            id=d.id, memory_space_kind=d.memory_kind, kind_id=0, device_ids=[d.id],
            debug_string=f"{d.memory_kind} of device {d.id}",
            to_string=f"{d.memory_kind} of device {d.id}"))
        resp.addressable_device_ids.append(d.id)
        resp.primary_device_ids.append(d.id)
    return resp


class Session:
    """One client's world: its ``Client`` (and so its controller and slices)."""

    def __init__(self, session_id: int, version: int, connect: Callable[[], object]):
        self.id = session_id
        self.version = version
        self._connect = connect
        self.client = None
        self.devices: list[ProxyDevice] = []
        self._closing = threading.Lock()

    def handle(self, request: ifrt_pb2.IfrtRequest) -> ifrt_pb2.IfrtResponse:
        kind = request.WhichOneof("request")
        response = ifrt_pb2.IfrtResponse()
        response.response_metadata.op_id = request.request_metadata.op_id
        try:
            if kind == "init_request":
                response.init_response.CopyFrom(self.init())
            else:
                self._fail(response, UNIMPLEMENTED,
                           f"pathways-ray's IFRT proxy does not serve {kind} yet: it serves "
                           f"sessions and devices (jax.devices()); arrays and programs come "
                           f"next")
        except Exception as e:  # noqa: BLE001 - the client must get the error, not a cut
            logger.warning("session %d: %s failed", self.id, kind, exc_info=True)
            self._fail(response, INTERNAL, f"{kind} failed on the pathways-ray proxy: "
                       f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}")
        return response

    @staticmethod
    def _fail(response, code: int, message: str) -> None:
        response.response_metadata.status.code = code
        response.response_metadata.status.message = message

    def init(self) -> ifrt_pb2.InitResponse:
        if self.client is None:
            self.client = self._connect()
            slices = [{**d, "topology": Topology.of(d["topology"])}
                      for d in self.client.describe()]
            self.devices = plan_devices(slices)
            logger.info("session %d: %d devices on %s", self.id, len(self.devices),
                        ", ".join(d["name"] for d in slices))
        return init_response(self.id, self.devices)

    def close(self) -> None:
        """Close the session's client (its controller, its slices); idempotent, and a
        second caller waits until the first has finished."""
        with self._closing:
            if self.client is not None:
                try:
                    self.client.close()
                finally:
                    self.client = None


class _Service(grpc_service.GrpcIfrtServiceServicer):
    def __init__(self, connect: Callable[[], object]):
        self._connect = connect
        self._lock = threading.Lock()
        self._next_id = 1
        self.sessions: dict[int, Session] = {}

    def GetVersion(self, request, context):  # noqa: N802 - gRPC's name
        try:
            chosen = versions.negotiate(request.min_version.protocol_version,
                                        request.max_version.protocol_version)
        except versions.VersionMismatch as e:
            logger.warning("refused a client: %s", e)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return grpc_pb2.GrpcGetVersionResponse(version=ifrt_pb2.IfrtProxyVersion(
            protocol_version=chosen, ifrt_serdes_version_number=versions.SERDES_VERSION))

    def _no_host_buffers(self, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "pathways-ray's IFRT proxy does not serve host buffers yet: it serves "
                      "sessions and devices (jax.devices()); arrays and programs come next")

    def HostBufferStore(self, request_iterator, context):  # noqa: N802
        self._no_host_buffers(context)

    def HostBufferLookup(self, request, context):  # noqa: N802
        self._no_host_buffers(context)

    def HostBufferDelete(self, request, context):  # noqa: N802
        self._no_host_buffers(context)

    def IfrtSession(self, request_iterator, context) -> Iterator:  # noqa: N802
        metadata = dict(context.invocation_metadata())
        meta = grpc_pb2.GrpcIfrtSessionMetadata()
        if SESSION_METADATA in metadata:
            meta.ParseFromString(metadata[SESSION_METADATA])
        with self._lock:
            session = Session(self._next_id, meta.version.protocol_version, self._connect)
            self._next_id += 1
            self.sessions[session.id] = session
        logger.info("session %d opened (protocol version %d, from %s)", session.id,
                    session.version, context.peer())
        try:
            for request in request_iterator:
                yield session.handle(request)
        finally:
            # Closed before it leaves the book: ProxyServer.stop() waits for it there.
            try:
                session.close()
            except Exception:  # noqa: BLE001 - the next session must still be served
                logger.warning("session %d: closing its client failed", session.id,
                               exc_info=True)
            with self._lock:
                self.sessions.pop(session.id, None)
            logger.info("session %d closed", session.id)


class ProxyServer:
    """Serve the IFRT proxy protocol for ``slices`` (each session reserves its own, as
    ``pathways_ray.connect(slices)`` does), or for leases of shared service ``service``
    (``slices`` then maps shapes to counts, ``{"v6e-2x2": 2}``).

    The process must be connected to the Ray cluster (or have ``$RAY_ADDRESS`` set).
    ``start()`` returns the address for ``JAX_BACKEND_TARGET``; ``exports`` are the
    lines a user sets.
    """

    def __init__(self, slices: list | dict | None = None, *, service: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_workers: int = 16):
        from pathways_ray.client.connect import connect

        if service is not None and not isinstance(slices, dict):
            raise ValueError(f"slices={slices!r} with service={service!r}: say what each "
                             f"session leases, e.g. slices={{'v6e-2x2': 2}}")
        self._service = _Service(lambda: connect(slices, service=service))
        self._server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="pathways-ray-proxy"))
        grpc_service.add_GrpcIfrtServiceServicer_to_server(self._service, self._server)
        self.host = host
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not listen on {host}:{port}")

    @property
    def address(self) -> str:
        return f"grpc://{self.host}:{self.port}"

    @property
    def exports(self) -> dict[str, str]:
        """What a JAX program's environment needs to use this server."""
        return {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": self.address,
                "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS": "true"}

    @property
    def sessions(self) -> int:
        return len(self._service.sessions)

    def start(self) -> str:
        self._server.start()
        logger.info("IFRT proxy serving at %s", self.address)
        return self.address

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving; returns once every session's client has closed and released
        its slices (one closing as its stream ends is waited for, not raced)."""
        self._server.stop(grace_s).wait(grace_s + 5)
        with self._service._lock:
            open_sessions = list(self._service.sessions.values())
        for session in open_sessions:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - the others must still be closed
                logger.warning("session %d: closing its client failed", session.id,
                               exc_info=True)
            with self._service._lock:
                self._service.sessions.pop(session.id, None)

    def __enter__(self) -> ProxyServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
