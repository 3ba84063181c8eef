"""A raw client of the IFRT proxy protocol, and a seeded mutator of its requests, for
``test_proxy_hardening``: what a malformed or hostile client can send, byte for byte.
"""

from __future__ import annotations

import queue
import random
import threading

import grpc
from google.protobuf.descriptor import FieldDescriptor

from pathways_ray.proxy.protos import (
    xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2 as grpc_pb2,
)
from pathways_ray.proxy.protos import (
    xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2_grpc as grpc_service,
)
from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2
from pathways_ray.proxy.server import SESSION_METADATA, STORE_METADATA, TOKEN_KEY

SESSION_METHOD = "/xla.ifrt.proxy.GrpcIfrtService/IfrtSession"
_RANGES = {FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
           FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
           FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
           FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
           FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
           FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
           FieldDescriptor.TYPE_ENUM: (-(1 << 31), (1 << 31) - 1)}


def session_metadata(version: int = 25, token: str | None = None) -> bytes:
    meta = grpc_pb2.GrpcIfrtSessionMetadata(
        version=ifrt_pb2.IfrtProxyVersion(protocol_version=version))
    if token is not None:
        meta.initialization_data.attributes[TOKEN_KEY].string_value = token.encode()
    return meta.SerializeToString()


class RawSession:
    """One ``IfrtSession`` stream, its requests sent as given (messages, or raw bytes
    with ``raw=True``), its responses collected by op id."""

    def __init__(self, port: int, *, token: str | None = None, raw: bool = False,
                 version: int = 25):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._out: queue.Queue = queue.Queue()
        self._answers: dict[int, ifrt_pb2.IfrtResponse] = {}
        self._cond = threading.Condition()
        self.ended: grpc.RpcError | None = None
        self.done = threading.Event()
        call = self.channel.stream_stream(
            SESSION_METHOD, request_serializer=(lambda b: b) if raw else
            ifrt_pb2.IfrtRequest.SerializeToString,
            response_deserializer=ifrt_pb2.IfrtResponse.FromString)
        self.call = call(iter(self._out.get, None),
                         metadata=[(SESSION_METADATA, session_metadata(version, token))])
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                with self._cond:
                    self._answers[response.response_metadata.op_id] = response
                    self._cond.notify_all()
        except grpc.RpcError as e:
            self.ended = e
        finally:
            self.done.set()
            with self._cond:
                self._cond.notify_all()

    def send(self, request) -> None:
        self._out.put(request)

    def answer(self, op_id: int, timeout_s: float) -> ifrt_pb2.IfrtResponse | None:
        """The response to ``op_id``; None if the stream ended without one."""
        with self._cond:
            ok = self._cond.wait_for(lambda: op_id in self._answers or self.done.is_set(),
                                     timeout_s)
            if not ok:
                raise TimeoutError(f"no answer to op {op_id} in {timeout_s} s")
            return self._answers.pop(op_id, None)

    def first_answer(self, timeout_s: float) -> ifrt_pb2.IfrtResponse | None:
        """Whichever response comes first; None if the stream ended without one."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._answers or self.done.is_set(), timeout_s)
            if not ok:
                raise TimeoutError(f"no answer and no end in {timeout_s} s")
            return next(iter(self._answers.values()), None)

    def ask(self, request: ifrt_pb2.IfrtRequest, timeout_s: float = 120):
        self.send(request)
        return self.answer(request.request_metadata.op_id, timeout_s)

    def close(self) -> None:
        self._out.put(None)
        self.call.cancel()
        self.channel.close()


def store(channel, session_id: int, handle: int, data: bytes,
          declared: int | None = None) -> grpc.StatusCode:
    """A ``HostBufferStore`` call; returns its status code."""
    meta = grpc_pb2.GrpcHostBufferStoreMetadata(
        session_id=session_id, handle=handle,
        buffer_size=len(data) if declared is None else declared)
    stub = grpc_service.GrpcIfrtServiceStub(channel)
    try:
        stub.HostBufferStore(iter([grpc_pb2.GrpcHostBufferStoreRequest(data=data)]),
                             metadata=[(STORE_METADATA, meta.SerializeToString())], timeout=60)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert "Traceback" not in (e.details() or ""), e.details()
        return e.code()


class Mutator:
    """Seeded mutations of recorded requests: numbers to edge values, handles off by
    one or made up, lists cut or grown, bytes cut or flipped, sub-messages cleared."""

    def __init__(self, seed: int, frozen: tuple[str, ...] = ()):
        self.rng = random.Random(seed)
        self.frozen = frozen  # fields left as recorded

    def number(self, field, value: int) -> int:
        low, high = _RANGES.get(field.type, (-(1 << 31), (1 << 31) - 1))
        r = self.rng
        pick = r.choice([0, 1, -1, value + 1, value - 1, high, low, 1 << 40, r.randint(low, high),
                         value * 2, 1 << 62])
        return max(low, min(high, pick))

    def mutate(self, message, depth: int = 0) -> None:
        fields = [f for f in message.DESCRIPTOR.fields
                  if (f.containing_oneof is None or message.HasField(f.name))
                  and f.name not in self.frozen]
        if not fields:
            return
        for _ in range(self.rng.randint(1, 3)):
            try:
                self._one(message, self.rng.choice(fields), depth)
            except (ValueError, TypeError):  # a value this field cannot hold at all
                pass

    def _one(self, message, field, depth: int) -> None:
        r = self.rng
        repeated = (field.is_repeated if hasattr(field, "is_repeated")
                    else field.label == FieldDescriptor.LABEL_REPEATED)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                return
            if repeated:
                items = getattr(message, field.name)
                if items and r.random() < 0.3:
                    del items[r.randrange(len(items))]
                elif items and depth < 4:
                    self.mutate(items[r.randrange(len(items))], depth + 1)
            elif r.random() < 0.25:
                message.ClearField(field.name)
            elif depth < 4:
                self.mutate(getattr(message, field.name), depth + 1)
            return
        if field.type in (FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING):
            if repeated:
                return
            value = getattr(message, field.name)
            if field.type == FieldDescriptor.TYPE_STRING:
                setattr(message, field.name, r.choice(["", "x" * 300, value[::-1],
                                                       "pinned_host", "unpinned_host"]))
            else:
                b = bytearray(value)
                if b and r.random() < 0.5:
                    b = b[:r.randrange(len(b))]
                for _ in range(r.randint(0, 4)):
                    if b:
                        b[r.randrange(len(b))] = r.randrange(256)
                setattr(message, field.name, bytes(b))
            return
        if field.type == FieldDescriptor.TYPE_BOOL:
            if not repeated:
                setattr(message, field.name, not getattr(message, field.name))
            return
        if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            return
        if repeated:
            items = getattr(message, field.name)
            choice = r.random()
            if items and choice < 0.3:
                del items[r.randrange(len(items))]
            elif choice < 0.6:
                items.append(self.number(field, items[-1] if items else 0))
            elif items:
                i = r.randrange(len(items))
                items[i] = self.number(field, items[i])
            return
        setattr(message, field.name, self.number(field, getattr(message, field.name)))
