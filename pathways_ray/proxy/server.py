"""``ProxyServer``: jaxlib's IFRT proxy protocol (``GrpcIfrtService``), served in front
of the single controller, so that an unmodified JAX program (``JAX_PLATFORMS=proxy``,
``pathwaysutils.initialize()``) runs on the fleet.

``GetVersion`` negotiates a protocol version (``versions``); each ``IfrtSession``
stream is one client's world (``session.Session``), with its host buffers on the
``HostBuffer*`` calls beside it.

Security: the server listens on 127.0.0.1 unless given another host, and on any
other it serves only sessions that present its token (``initialization_data``
``pathways_ray_token``; optional on loopback). Session ids are random: the host-buffer
calls, which name a session by its id alone, cannot reach another's. The gRPC is
plain (``IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS=true`` on the client; jaxlib reads
"true" only: "1" still asks for ALTS), so the token crosses the network in the clear:
keep the server on loopback, or behind the cluster's own network controls (a
Kubernetes NetworkPolicy, a private VPC).
"""

from __future__ import annotations

import hmac
import logging
import queue
import secrets
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from pathways_ray.proxy import versions
from pathways_ray.proxy.protos import (
    xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2 as grpc_pb2,
)
from pathways_ray.proxy.protos import (
    xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2_grpc as grpc_service,
)
from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2
from pathways_ray.proxy.session import Session

__all__ = ["ProxyServer"]

logger = logging.getLogger(__name__)

SESSION_METADATA = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
STORE_METADATA = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"
TOKEN_KEY = "pathways_ray_token"  # in the client's initialization_data
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
CHUNK = 4 << 20  # bytes per message of a host buffer on its way back


class _Service(grpc_service.GrpcIfrtServiceServicer):
    def __init__(self, connect: Callable[[], object], token: str | None = None):
        self._connect = connect
        self.token = token
        self._lock = threading.Lock()
        self.sessions: dict[int, Session] = {}
        self.closed: list[dict[str, int]] = []  # the counters of sessions that ended

    def GetVersion(self, request, context):  # noqa: N802 - gRPC's name
        try:
            chosen = versions.negotiate(request.min_version.protocol_version,
                                        request.max_version.protocol_version)
        except versions.VersionMismatch as e:
            logger.warning("refused a client: %s", e)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return grpc_pb2.GrpcGetVersionResponse(version=ifrt_pb2.IfrtProxyVersion(
            protocol_version=chosen, ifrt_serdes_version_number=versions.SERDES_VERSION))

    def _session(self, session_id: int, context) -> Session:
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no open session {session_id}")
        return session

    def HostBufferStore(self, request_iterator, context):  # noqa: N802 - gRPC's name
        meta = grpc_pb2.GrpcHostBufferStoreMetadata()
        raw = dict(context.invocation_metadata()).get(STORE_METADATA)
        if raw is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "HostBufferStore without metadata")
        meta.ParseFromString(raw)
        session = self._session(meta.session_id, context)
        data = b"".join(r.data for r in request_iterator)
        if len(data) != meta.buffer_size:
            context.abort(grpc.StatusCode.DATA_LOSS, f"host buffer {meta.handle}: "
                          f"{len(data)} of {meta.buffer_size} bytes arrived")
        session.counters["host_bytes_in"] += len(data)
        try:
            session.host_buffers.store(meta.handle, data)
        except ValueError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return grpc_pb2.GrpcHostBufferStoreResponse()

    def HostBufferLookup(self, request, context):  # noqa: N802
        session = self._session(request.session_id, context)
        try:
            data = session.host_buffers.lookup(request.handle)
        except (TimeoutError, RuntimeError) as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        for i in range(0, max(len(data), 1), CHUNK):
            yield grpc_pb2.GrpcHostBufferLookupResponse(data=data[i:i + CHUNK])

    def HostBufferDelete(self, request, context):  # noqa: N802
        session = self._session(request.session_id, context)
        if not session.host_buffers.delete(request.handle):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no host buffer {request.handle}")
        return grpc_pb2.GrpcHostBufferDeleteResponse()

    def _refusal(self, meta, peer: str) -> str | None:
        """Why a session is refused (no token, or another), or None. The session is
        still opened, to answer its InitRequest with that reason: a refused stream
        reads to jaxlib's client as a server to retry, and hides it."""
        if self.token is None:
            return None
        given = meta.initialization_data.attributes.get(TOKEN_KEY)
        if given is None:
            logger.warning("refused a session from %s: no token", peer)
            return (f"this pathways-ray proxy serves only sessions that present its token: "
                    f"give the client initialization_data={{'{TOKEN_KEY}': "
                    f"$PATHWAYS_RAY_PROXY_TOKEN}} (see 'Run your JAX program unchanged' in "
                    f"the docs)")
        if not hmac.compare_digest(given.string_value, self.token.encode()):
            logger.warning("refused a session from %s: a wrong token", peer)
            return ("the token this session presented is not this proxy's "
                    "($PATHWAYS_RAY_PROXY_TOKEN where the proxy was started)")
        return None

    def IfrtSession(self, request_iterator, context) -> Iterator:  # noqa: N802
        metadata = dict(context.invocation_metadata())
        meta = grpc_pb2.GrpcIfrtSessionMetadata()
        if SESSION_METADATA in metadata:
            meta.ParseFromString(metadata[SESSION_METADATA])
        refused = self._refusal(meta, context.peer())
        with self._lock:
            # A random id: the host-buffer calls name their session by it alone.
            session = Session(secrets.randbits(62), meta.version.protocol_version,
                              self._connect, refused=refused)
            if refused is None:
                self.sessions[session.id] = session
        logger.info("session %d opened (protocol version %d, from %s)", session.id,
                    session.version, context.peer())
        responses: queue.Queue = queue.Queue()

        def read() -> None:  # requests in order; waits answer when done
            pending = []
            try:
                for request in request_iterator:
                    f = session.submit(request, responses.put)
                    if f is not None:
                        pending.append(f)
                    pending = [p for p in pending if not p.done()]
                futures.wait(pending)
            except Exception as e:  # noqa: BLE001 - the client went away: the session ends
                logger.info("session %d: its stream ended (%s)", session.id, type(e).__name__)
            finally:
                responses.put(None)

        context.add_callback(lambda: responses.put(None))
        threading.Thread(target=read, name=f"proxy-session-{session.id}-reader",
                         daemon=True).start()
        try:
            while (response := responses.get()) is not None:
                yield response
        finally:
            # Closed before it leaves the book: ProxyServer.stop() waits for it there.
            try:
                session.close()
            except Exception:  # noqa: BLE001 - the next session must still be served
                logger.warning("session %d: closing its client failed", session.id,
                               exc_info=True)
            with self._lock:
                if self.sessions.pop(session.id, None) is not None:
                    self.closed.append(session.stats())
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
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_workers: int = 16):
        from pathways_ray.client.connect import connect

        if service is not None and not isinstance(slices, dict):
            raise ValueError(f"slices={slices!r} with service={service!r}: say what each "
                             f"session leases, e.g. slices={{'v6e-2x2': 2}}")
        if token is None and host not in LOOPBACK:
            raise ValueError(f"host={host!r} serves the network: give token=... (the "
                             f"CLI makes one), so that only its holders get a session")
        self.token = token
        self._service = _Service(lambda: connect(slices, service=service), token)
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
        out = {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": self.address,
               "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS": "true"}
        if self.token is not None:
            out["PATHWAYS_RAY_PROXY_TOKEN"] = self.token
        return out

    @property
    def sessions(self) -> int:
        return len(self._service.sessions)

    def stats(self) -> dict[str, int]:
        """Sessions so far and the bytes that passed through this server, summed over
        them: ``host_bytes_in``/``_out`` (the clients' host buffers), ``put_bytes``/
        ``fetched_bytes`` (between this process and the chips)."""
        with self._service._lock:
            each = self._service.closed + [s.stats() for s in self._service.sessions.values()]
        out = {k: sum(c[k] for c in each) for k in ("host_bytes_in", "host_bytes_out",
                                                    "put_bytes", "fetched_bytes")}
        return {"sessions": len(each), **out}

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
