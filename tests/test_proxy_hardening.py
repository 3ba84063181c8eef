"""A proxy that one client cannot break for the others (2 emulated v6e 2x2 slices):
streams without the token hold nothing, a client cut off while its session connects
leaves no lease behind, a 64 MiB program compiles, and thousands of malformed or
mutated requests (seeded) each get an error status, no traceback, while a
well-behaved session beside them trains with local JAX's losses; nothing leaks."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2
from tests import proxy_scripts
from tests.proxy_fuzz import Mutator, RawSession, store
from tests.test_proxy import _script
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

TOKEN = "hardening-t0ken"


@pytest.fixture(scope="module")
def fleet():
    from pathways_ray import LocalFleet

    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="tharden",
                    log_to_driver=False) as fleet:
        yield fleet
    import ray

    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def server(fleet):
    """Sessions of one 2x2 slice each; a request waits 1 s for a host buffer that was
    never stored (the fuzzer names made-up ones)."""
    from pathways_ray.proxy.server import ProxyServer

    with ProxyServer(["v6e-2x2"], host_buffer_timeout_s=1.0) as server:
        yield server
    assert server.sessions == 0


def _sessions_leave_nothing(fleet) -> None:
    """No controller, chip worker or sidecar process is alive on the fleet (Ray names an
    actor's process ``ray::<Class>``) and every slice is free."""
    import psutil

    from pathways_ray import _procs
    from pathways_ray.clusters.cluster import cluster_slices

    def actors() -> list[str]:
        out = []
        for p in _procs.find(fleet.fleet_id, fleet._state.all_sessions()):
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if title.startswith(("ray::Controller", "ray::ChipWorker", "ray::SidecarHost")):
                out.append(title)
        return out

    wait_until(lambda: not actors() and all(v.idle for v in cluster_slices()), 60,
               "a session's controller, chips or slice outlived it",
               detail=lambda: f"{actors()} {[v.idle for v in cluster_slices()]}")


def _request(op_id: int, **kind) -> ifrt_pb2.IfrtRequest:
    return ifrt_pb2.IfrtRequest(request_metadata=ifrt_pb2.RequestMetadata(op_id=op_id), **kind)


def test_streams_without_the_token_hold_no_thread_and_delay_no_session(fleet):
    """32 token-less streams left open (they never send a request) against a server
    of 16 workers: each is closed within seconds, and an authenticated session
    meanwhile gets its devices and trains."""
    from pathways_ray.proxy.server import REFUSAL_WAIT_S, ProxyServer

    with ProxyServer(["v6e-2x2"], token=TOKEN, max_workers=16) as guarded:
        idle = [RawSession(guarded.port, token=None) for _ in range(32)]
        try:
            t0 = time.monotonic()
            got = _script(proxy_scripts.TOKEN_TRAIN, guarded, timeout_s=240)
            assert got["n"] == 4 and len(got["losses"]) == 5
            for raw in idle:
                assert raw.done.wait(max(1.0, REFUSAL_WAIT_S + 10 - (time.monotonic() - t0)))
        finally:
            for raw in idle:
                raw.close()
        # (the session closes as its stream ends, on the server's own time)
        wait_until(lambda: guarded.sessions == 0, 60, "the script's session did not close")
        assert guarded.stats()["sessions"] == 1
    _sessions_leave_nothing(fleet)


def test_a_client_cut_off_while_its_session_connects_leaves_nothing_behind(server, fleet):
    """The stream ends 1 s into InitRequest (the session is reserving a slice and
    starting its chips): the session closes the client it was connecting as soon as
    it is made; no controller, chip worker or reservation is left."""
    raw = RawSession(server.port)
    raw.send(_request(1, init_request={}))
    time.sleep(1.0)
    raw.close()
    wait_until(lambda: server.sessions == 0, 120, "the cut-off session did not close")
    _sessions_leave_nothing(fleet)


def test_a_64_mib_program_compiles_and_runs(server):
    """A program holding a 64 MiB constant (a real model's StableHLO is as large)
    passes gRPC's limits both ways, compiles on the chips and gives local values."""
    got = _script(proxy_scripts.BIG_PROGRAM, server, timeout_s=300)
    want = _script(proxy_scripts.BIG_PROGRAM, timeout_s=300)
    assert got["program_bytes"] > 64 << 20, got
    assert got["sum"] == want["sum"]


def _record(server, monkeypatch) -> tuple[list[ifrt_pb2.IfrtRequest], dict[int, bytes]]:
    """What a real JAX client sends: the requests and host buffers of a training script."""
    from pathways_ray.proxy.host_buffers import HostBuffers
    from pathways_ray.proxy.session import Session

    requests, buffers = [], {}
    submit, keep = Session.submit, HostBuffers.store

    def recording(self, request, respond):
        requests.append(ifrt_pb2.IfrtRequest.FromString(request.SerializeToString()))
        return submit(self, request, respond)

    def stored(self, handle, data):
        buffers.setdefault(handle, data)
        return keep(self, handle, data)

    monkeypatch.setattr(Session, "submit", recording)
    monkeypatch.setattr(HostBuffers, "store", stored)
    _script(proxy_scripts.TRAIN_ONE_SLICE, server)
    monkeypatch.undo()
    return requests, buffers


def _host_buffers_of(request: ifrt_pb2.IfrtRequest) -> list[int]:
    kind = request.WhichOneof("request")
    if kind == "make_array_from_host_buffer_request":
        return [request.make_array_from_host_buffer_request.host_buffer_handle]
    if kind == "make_arrays_from_host_buffer_shards_request":
        return [hb.host_buffer_handle
                for spec in request.make_arrays_from_host_buffer_shards_request.specs
                for hb in spec.host_buffers]
    return []


def test_thousands_of_malformed_requests_each_get_an_error_and_break_nothing(server, fleet,
                                                                           monkeypatch):
    """Seeded fuzzing of a live server: 5,200 requests in all. Recorded requests of a
    real client, mutated (handles, shapes, strides, dtypes, device ids, shardings,
    programs, options), sent before and after InitRequest; truncated and garbage
    protos; host-buffer stores of the wrong size or session. Every bad request gets an
    error status naming no Python traceback and no incident of an internal error;
    meanwhile a well-behaved session trains with local JAX's losses; afterwards no
    session thread, session, controller, chip worker or reservation is left."""
    corpus, buffers = _record(server, monkeypatch)
    kinds = {r.WhichOneof("request") for r in corpus}
    assert {"make_array_from_host_buffer_request", "compile_request",
            "loaded_executable_execute_request", "copy_to_host_buffer_request"} <= kinds
    # A host buffer that never comes is waited for (1 s here): one request below asks
    # for one; the mutations leave those handles be.
    mut = Mutator(seed=20261206, frozen=("host_buffer_handle",))
    sent = {"requests": 0, "errors": 0, "ok": 0}
    messages: list[str] = []

    def check(response, expect_error: bool) -> None:
        sent["requests"] += 1
        assert response is not None, "a request went unanswered"
        status = response.response_metadata.status
        messages.append(status.message)
        if status.code:
            sent["errors"] += 1
        else:
            sent["ok"] += 1
            assert not expect_error, f"accepted: {response}"

    good = {}
    beside = threading.Thread(target=lambda: good.update(_script(proxy_scripts.TRAIN_ONE_SLICE,
                                                                 server, timeout_s=600)))
    beside.start()
    try:
        # 1. Before InitRequest: every request out of order (never an init: it reserves).
        raw = RawSession(server.port)
        for op in range(1, 1001):
            r = ifrt_pb2.IfrtRequest()
            r.CopyFrom(mut.rng.choice([c for c in corpus
                                       if c.WhichOneof("request") != "init_request"]))
            mut.mutate(getattr(r, r.WhichOneof("request")))
            r.request_metadata.op_id = op
            check(raw.ask(r, 60), expect_error=True)
        raw.close()
        # 2. Protos that do not parse (cut short, or random bytes): an error, and the
        #    stream ends. (Bytes that happen to parse as an InitRequest are not sent.)
        garbage_sent = 0
        while garbage_sent < 100:
            blob = mut.rng.choice(corpus).SerializeToString()
            blob = (blob[:mut.rng.randrange(1, max(2, len(blob)))] + b"\xff\xff\xff"
                    if garbage_sent % 2 else mut.rng.randbytes(40))
            try:
                if ifrt_pb2.IfrtRequest.FromString(blob).HasField("init_request"):
                    continue
            except Exception:  # noqa: BLE001 - does not parse: what is wanted
                pass
            garbage = RawSession(server.port, raw=True)
            garbage.send(blob)
            answer = garbage.first_answer(30)
            if answer is not None:
                check(answer, expect_error=True)
            else:
                assert garbage.ended is None or "Traceback" not in garbage.ended.details()
                sent["requests"] += 1
            garbage.close()
            garbage_sent += 1
        # 3. An initialized session: the corpus replayed, then mutated.
        raw = RawSession(server.port)
        init = raw.ask(_request(1, init_request={}), 180)
        assert init.response_metadata.status.code == 0, init
        session_id = init.init_response.session_id
        for handle, data in buffers.items():
            assert store(raw.channel, session_id, handle, data) == grpc.StatusCode.OK
        op = 1
        for r in corpus:
            if r.WhichOneof("request") == "init_request":
                continue
            op += 1
            r.request_metadata.op_id = op
            raw.ask(r, 120)
        mutable = [c for c in corpus if c.WhichOneof("request") != "init_request"]
        compiles = 0
        while sent["requests"] < 5000:
            r = ifrt_pb2.IfrtRequest()
            r.CopyFrom(mut.rng.choice(mutable))
            kind = r.WhichOneof("request")
            if kind == "compile_request":
                compiles += 1
                if compiles > 15:  # a compile takes seconds on two cores
                    continue
            mut.mutate(getattr(r, kind))
            for handle in _host_buffers_of(r):  # a request takes the buffers it names
                if handle in buffers:
                    store(raw.channel, session_id, handle, buffers[handle])
            op += 1
            r.request_metadata.op_id = op
            check(raw.ask(r, 120), expect_error=False)
        missing = ifrt_pb2.IfrtRequest()
        missing.CopyFrom(next(c for c in corpus
                              if c.WhichOneof("request") == "make_array_from_host_buffer_request"))
        missing.make_array_from_host_buffer_request.host_buffer_handle = 987_654_321
        missing.make_array_from_host_buffer_request.array_handle = 987_654_321
        op += 1
        missing.request_metadata.op_id = op
        answer = raw.ask(missing, 60)
        check(answer, expect_error=True)
        assert "host buffer 987654321 did not arrive" in answer.response_metadata.status.message
        # 4. Host-buffer stores that lie: sizes, sessions, handles.
        for i in range(50):
            data = bytes(64)
            assert store(raw.channel, session_id, 10_000 + i, data, declared=128) == \
                grpc.StatusCode.DATA_LOSS
            assert store(raw.channel, session_id, 20_000 + i, data, declared=16) == \
                grpc.StatusCode.INVALID_ARGUMENT
            assert store(raw.channel, session_id ^ (1 << 40), 30_000 + i, data) == \
                grpc.StatusCode.NOT_FOUND
            assert store(raw.channel, session_id, 40_000, data) == (
                grpc.StatusCode.OK if i == 0 else grpc.StatusCode.ALREADY_EXISTS)
            sent["requests"] += 4
        raw.close()
    finally:
        beside.join(600)
    assert sent["requests"] >= 5000, sent
    assert not [m for m in messages if "Traceback" in m or 'File "' in m]
    assert not [m for m in messages if "internal error" in m], \
        [m for m in messages if "internal error" in m][:5]
    want = _script(proxy_scripts.TRAIN_ONE_SLICE)
    np.testing.assert_allclose(good["losses"], want["losses"], rtol=1e-5)
    wait_until(lambda: server.sessions == 0, 120, "a fuzzed session did not close")
    assert not [t.name for t in threading.enumerate() if t.name.startswith("proxy-session")]
    _sessions_leave_nothing(fleet)
    print(f"fuzz: {sent}")


def test_the_session_id_is_in_no_log_line(server, caplog):
    """A real session logged at DEBUG: its secret id is nowhere in the server's log."""
    import logging

    ids = []
    watch = threading.Event()

    def note():
        while not watch.is_set():
            ids.extend(server._service.sessions)
            time.sleep(0.05)

    spy = threading.Thread(target=note, daemon=True)
    with caplog.at_level(logging.DEBUG, logger="pathways_ray"):
        spy.start()
        _script(proxy_scripts.TRAIN_ONE_SLICE, server)
        watch.set()
        spy.join()
    assert ids
    for sid in set(ids):
        assert str(sid) not in caplog.text and f"{sid:x}" not in caplog.text


def test_a_clients_debug_flags_write_nothing_on_the_hosts(server, tmp_path):
    """MaxText sets ``XLA_FLAGS=--xla_dump_to=...`` on its own, and a client's flags
    travel in its compile options: the chips must not write where a client says (here
    the hosts' disk is this machine's, so a dump would show)."""
    dump = tmp_path / "xla_dump"
    got = _script(proxy_scripts.TRAIN_ONE_SLICE, server, env={
        "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
    assert len(got["losses"]) == 10
    assert not dump.exists(), sorted(p.name for p in dump.iterdir())[:5]
