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
Kubernetes NetworkPolicy, a private VPC). A session's id is a secret: logs and
thread names call a session by its number (``Session.number``) instead.

Capacity: every open session holds one of the server's ``max_workers`` gRPC threads
for its stream (default 128); a stream that presents no valid token is answered at
once and closed, and one that sends no ``InitRequest`` within ``INIT_TIMEOUT_S`` is
closed, so neither holds a thread. A message (a program, one chunk of a host
buffer) may be up to ``MAX_MESSAGE_BYTES`` (1 GiB; gRPC's default of 4 MiB is less
than a real model's StableHLO).
"""

from __future__ import annotations

import hmac
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError

from pathways_ray.proxy import versions
from pathways_ray.proxy.errors import INVALID_ARGUMENT
from pathways_ray.proxy.program_parser import ProgramParser
from pathways_ray.proxy.protos import (
    xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2 as grpc_pb2,
)
from pathways_ray.proxy.protos import (
    xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2_grpc as grpc_service,
)
from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2
from pathways_ray.proxy.session import Session
from pathways_ray.proxy.warm import WarmClients

__all__ = ["ProxyServer"]

logger = logging.getLogger(__name__)

SESSION_METADATA = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
STORE_METADATA = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"
TOKEN_KEY = "pathways_ray_token"  # in the client's initialization_data
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
CHUNK = 4 << 20  # bytes per message of a host buffer on its way back
MAX_MESSAGE_BYTES = 1 << 30  # a program, or a chunk of a host buffer
INIT_TIMEOUT_S = 60.0  # a stream that sends no InitRequest in this long is closed
REFUSAL_WAIT_S = 5.0  # how long a refused stream may take to send its InitRequest
LOOKUP_TIMEOUT_S = 60.0  # a host buffer asked for before it is stored is waited for
# Calls gRPC holds for the server before a handler takes them up. jaxlib's client sends
# every device_put as a HostBufferStore call of its own, with no limit; past gRPC's
# default of 1,000 such calls new ones are cancelled at random (at 3,000 all of them),
# and jaxlib drops the whole session on one cancelled store (measured: 2,000 queued put
# pairs). What a held call costs the server is its headers and at most its HTTP/2
# flow-control window of data; the rest waits on the client.
MAX_PENDING_CALLS = 1 << 20


class Malformed:
    """A message that did not parse. The server's handlers read it as a bad request
    (gRPC's own deserializer would log a traceback for each, at ERROR)."""

    def __init__(self, kind: str, error: str):
        self.kind, self.error = kind, error

    def __str__(self) -> str:
        return f"a {self.kind} that does not parse: {self.error}"


def _lenient(cls) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Malformed(cls.__name__, str(e))

    return parse


def _register(servicer, server) -> None:
    """``add_GrpcIfrtServiceServicer_to_server``, with requests parsed leniently."""
    kinds = {"GetVersion": (grpc.unary_unary_rpc_method_handler, "GrpcGetVersion"),
             "IfrtSession": (grpc.stream_stream_rpc_method_handler, None),
             "HostBufferStore": (grpc.stream_unary_rpc_method_handler, "GrpcHostBufferStore"),
             "HostBufferLookup": (grpc.unary_stream_rpc_method_handler, "GrpcHostBufferLookup"),
             "HostBufferDelete": (grpc.unary_unary_rpc_method_handler, "GrpcHostBufferDelete"),
             "HostBufferReadFromDisk": (grpc.unary_unary_rpc_method_handler,
                                        "GrpcHostBufferReadFromDisk")}
    handlers = {}
    for method, (make, prefix) in kinds.items():
        request, response = ((ifrt_pb2.IfrtRequest, ifrt_pb2.IfrtResponse) if prefix is None
                             else (getattr(grpc_pb2, prefix + "Request"),
                                   getattr(grpc_pb2, prefix + "Response")))
        handlers[method] = make(getattr(servicer, method),
                                request_deserializer=_lenient(request),
                                response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "xla.ifrt.proxy.GrpcIfrtService", handlers),))


def _check(request, context):
    if isinstance(request, Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
    return request


class _Service(grpc_service.GrpcIfrtServiceServicer):
    def __init__(self, clients: WarmClients, token: str | None = None,
                 host_buffer_timeout_s: float = 300.0):
        self.clients = clients
        self.token = token
        self.host_buffer_timeout_s = host_buffer_timeout_s
        self.parser = ProgramParser()  # every session's programs are read out of process
        self._lock = threading.Lock()
        self.sessions: dict[int, Session] = {}
        self.closed: list[dict[str, int]] = []  # the counters of sessions that ended

    def GetVersion(self, request, context):  # noqa: N802 - gRPC's name
        _check(request, context)
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
        if session is None:  # (the id is the caller's own: not repeated, not logged)
            context.abort(grpc.StatusCode.NOT_FOUND, "no open session has that id")
        return session

    def HostBufferStore(self, request_iterator, context):  # noqa: N802 - gRPC's name
        meta = grpc_pb2.GrpcHostBufferStoreMetadata()
        raw = dict(context.invocation_metadata()).get(STORE_METADATA)
        if raw is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "HostBufferStore without metadata")
        try:
            meta.ParseFromString(raw)
        except DecodeError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "HostBufferStore metadata does "
                          "not parse")
        session = self._session(meta.session_id, context)
        chunks, size = [], 0
        for r in request_iterator:
            size += len(_check(r, context).data)
            if size > meta.buffer_size:  # never hold more than the client declared
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"host buffer {meta.handle}: "
                              f"more than the {meta.buffer_size} bytes declared arrived")
            chunks.append(r.data)
        if size != meta.buffer_size:
            context.abort(grpc.StatusCode.DATA_LOSS, f"host buffer {meta.handle}: "
                          f"{size} of {meta.buffer_size} bytes arrived")
        session.count("host_bytes_in", size)
        try:
            session.host_buffers.store(meta.handle, b"".join(chunks))
        except ValueError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return grpc_pb2.GrpcHostBufferStoreResponse()

    def HostBufferLookup(self, request, context):  # noqa: N802
        session = self._session(_check(request, context).session_id, context)
        try:
            data = session.host_buffers.lookup(request.handle, LOOKUP_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        for i in range(0, max(len(data), 1), CHUNK):
            yield grpc_pb2.GrpcHostBufferLookupResponse(data=data[i:i + CHUNK])

    def HostBufferDelete(self, request, context):  # noqa: N802
        session = self._session(_check(request, context).session_id, context)
        if not session.host_buffers.delete(request.handle):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no host buffer {request.handle}")
        return grpc_pb2.GrpcHostBufferDeleteResponse()

    def HostBufferReadFromDisk(self, request, context):  # noqa: N802
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "host buffers read from the server's "
                      "disk are not served by the pathways-ray proxy")

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
        try:
            meta.ParseFromString(metadata.get(SESSION_METADATA, b""))
        except DecodeError:
            meta = grpc_pb2.GrpcIfrtSessionMetadata()
        refused = self._refusal(meta, context.peer())
        with self._lock:
            # A random id: the host-buffer calls name their session by it alone.
            session = Session(secrets.randbits(62), meta.version.protocol_version,
                              self.clients.take, refused=refused, parser=self.parser,
                              host_buffer_timeout_s=self.host_buffer_timeout_s,
                              release=self.clients.give_back)
            if refused is None:
                self.sessions[session.id] = session
        logger.info("session %d opened (protocol version %d, from %s)", session.number,
                    session.version, context.peer())
        responses: queue.Queue = queue.Queue()
        got_init = threading.Event()

        def read() -> None:  # requests in order; waits answer when done
            pending = []
            try:
                for request in request_iterator:
                    if isinstance(request, Malformed):  # the stream is beyond repair
                        bad = ifrt_pb2.IfrtResponse()
                        bad.response_metadata.status.code = INVALID_ARGUMENT
                        bad.response_metadata.status.message = str(request)
                        responses.put(bad)
                        logger.info("session %d: %s; closed", session.number, request)
                        break
                    if request.WhichOneof("request") == "init_request":
                        got_init.set()
                    f = session.submit(request, responses.put)
                    if f is not None:
                        pending.append(f)
                    pending = [p for p in pending if not p.done()]
                futures.wait(pending)
            except Exception as e:  # noqa: BLE001 - the client went away: the session ends
                logger.info("session %d: its stream ended (%s)", session.number,
                            type(e).__name__)
            finally:
                responses.put(None)

        context.add_callback(lambda: responses.put(None))
        threading.Thread(target=read, name=f"proxy-session-{session.number}-reader",
                         daemon=True).start()
        try:
            if refused is not None:
                # Its InitRequest answered with why (a cut stream reads to jaxlib's client
                # as a server to retry), then closed: it holds no thread of the server.
                try:
                    first = responses.get(timeout=REFUSAL_WAIT_S)
                except queue.Empty:
                    return
                if first is not None:
                    yield first
                return
            start = time.monotonic()
            while not got_init.is_set():  # a stream that never initializes is closed
                try:
                    response = responses.get(timeout=0.5)
                except queue.Empty:
                    if time.monotonic() - start > INIT_TIMEOUT_S:
                        logger.info("session %d sent no InitRequest in %.0f s: closed",
                                    session.number, INIT_TIMEOUT_S)
                        return
                    continue
                if response is None:
                    return
                yield response
            while (response := responses.get()) is not None:
                yield response
        finally:
            # Closed before it leaves the book: ProxyServer.stop() waits for it there.
            try:
                session.close()
            except Exception:  # noqa: BLE001 - the next session must still be served
                logger.warning("session %d: closing its client failed", session.number,
                               exc_info=True)
            with self._lock:
                if self.sessions.pop(session.id, None) is not None:
                    self.closed.append(session.stats())
            logger.info("session %d closed", session.number)


class ProxyServer:
    """Serve the IFRT proxy protocol for ``slices`` (each session reserves its own, as
    ``pathways_ray.connect(slices)`` does), or for leases of shared service ``service``
    (``slices`` then maps shapes to counts, ``{"v6e-2x2": 2}``).

    ``host_buffer_timeout_s`` bounds how long a request waits for a host buffer the
    client has not stored (yet): its store travels on a call of its own, which a
    burst of puts can hold back. The process must be connected to the Ray cluster (or
    have ``$RAY_ADDRESS`` set). ``warm``: a client (slices, chip workers) is made when
    the server starts and handed from session to session (``proxy.warm``); it holds its
    slices while no session runs, so it is for a fleet that serves this proxy
    (``pathways-ray proxy`` turns it on unless ``--cold``).
    ``start()`` returns the address for ``JAX_BACKEND_TARGET``; ``exports`` are the
    lines a user sets.
    """

    def __init__(self, slices: list | dict | None = None, *, service: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_workers: int = 128, host_buffer_timeout_s: float = 300.0,
                 warm: bool = False):
        from pathways_ray.client.connect import connect

        if service is not None and not isinstance(slices, dict):
            raise ValueError(f"slices={slices!r} with service={service!r}: say what each "
                             f"session leases, e.g. slices={{'v6e-2x2': 2}}")
        if token is None and host not in LOOPBACK:
            raise ValueError(f"host={host!r} serves the network: give token=... (the "
                             f"CLI makes one), so that only its holders get a session")
        self.token = token
        # A session's own slices are one JAX world (a mesh may span them, and survives
        # losing one); a lease's are separate worlds.
        joint = service is None and len(slices or []) > 1
        # Sessions of its own slices take a client made ahead (slices reserved, chip
        # workers up) and hand it on emptied; a lease from a shared service is taken
        # per session and given back at its end, not held idle.
        self.clients = WarmClients(
            lambda **kw: connect(slices, service=service, multislice=joint, **kw),
            enabled=service is None and warm)
        self._service = _Service(self.clients, token, host_buffer_timeout_s)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers,
                                       thread_name_prefix="pathways-ray-proxy"),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                     ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS)])
        _register(self._service, self._server)
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
        ``fetched_bytes`` (between this process and the chips), and ``fetches`` (reads
        from the chips, each one round trip)."""
        with self._service._lock:
            each = self._service.closed + [s.stats() for s in self._service.sessions.values()]
        out = {k: sum(c[k] for c in each) for k in ("host_bytes_in", "host_bytes_out",
                                                    "put_bytes", "fetched_bytes", "fetches")}
        return {"sessions": len(each), **out}

    def start(self) -> str:
        self._server.start()
        self.clients.start()
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
                logger.warning("session %d: closing its client failed", session.number,
                               exc_info=True)
            with self._service._lock:
                self._service.sessions.pop(session.id, None)
        self.clients.close()
        self._service.parser.close()

    def __enter__(self) -> ProxyServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
