"""The IFRT proxy's pure parts (``pathways_ray.proxy``): the protocol stubs are this
jaxlib's, versions are negotiated or refused by name, devices carry what JAX and
pathwaysutils read, and a session answers every request (an error by name for what
it does not serve). No Ray, no fleet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pathways_ray.clusters.topology import Topology
from pathways_ray.proxy import versions
from pathways_ray.proxy.devices import init_response, plan_devices
from pathways_ray.proxy.errors import INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED
from pathways_ray.proxy.protos import xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2
from pathways_ray.proxy.session import Session

ROOT = Path(__file__).resolve().parent.parent


def test_the_checked_in_stubs_are_what_this_jaxlib_speaks():
    """Regenerated from the descriptors inside jaxlib with grpcio-tools, they are the
    checked-in files byte for byte."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_ifrt_proxy_protos.py"),
                          "--check"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    if "not checked" in out.stdout:
        pytest.skip(out.stdout.strip())


def test_versions_are_negotiated_or_refused_naming_both_ranges():
    assert versions.negotiate(16, 25) == 25  # jaxlib 0.10.2's own client
    assert versions.negotiate(16, 28) == 28  # jaxlib 0.12.1's
    assert versions.negotiate(10, 18) == 18
    assert versions.negotiate(20, 40) == versions.MAX_VERSION
    with pytest.raises(versions.VersionMismatch, match=r"versions 3\.\.5, .* 16\.\.28"):
        versions.negotiate(3, 5)
    with pytest.raises(versions.VersionMismatch, match=r"30\.\.40"):
        versions.negotiate(30, 40)
    with pytest.raises(versions.VersionMismatch, match="empty range"):
        versions.negotiate(20, 18)


def _described(platform="cpu"):
    topo = Topology.of("v6e-2x2")
    return [{"name": f"s{i}", "topology": topo, "platform": platform,
             "workers": [(r, 0, r) for r in (3, 1, 0, 2)]} for i in range(2)]


def test_devices_run_over_the_slices_with_their_slice_index_and_coords():
    devices = plan_devices(_described())
    assert [d.id for d in devices] == list(range(8))
    assert [d.slice_index for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [d.rank for d in devices[:4]] == [0, 1, 2, 3]  # rank order, not worker order
    assert [d.coords for d in devices[:4]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert {d.device_kind for d in devices} == {"cpu"}
    tpu = plan_devices(_described("tpu"))  # the chips, then each chip's CPU device
    assert [d.device_kind for d in tpu] == ["TPU v6 lite"] * 8 + ["cpu"] * 8
    with pytest.raises(ValueError, match="platform='gpu' of slice s0"):
        plan_devices(_described("gpu"))


def test_the_init_response_says_what_jax_reads():
    resp = init_response(7, plan_devices(_described()))
    assert resp.session_id == 7 and resp.platform_name == "cpu"
    assert list(resp.addressable_device_ids) == list(range(8))
    d = resp.all_devices[5]
    attrs = d.attributes.attributes
    assert attrs["slice_index"].int64_value == 1
    assert list(attrs["coords"].int64_list_value.elements) == [1, 0, 0]
    assert attrs["core_on_chip"].int64_value == 0
    # Each chip's device memory, then its host's pinned and unpinned memory (ids n+d, 2n+d).
    assert list(d.memory_ids) == [5, 13, 21] and d.default_memory_id == 5
    memories = {m.id: m for m in resp.memories}
    assert [memories[m].memory_space_kind for m in (5, 13, 21)] == [
        "device", "pinned_host", "unpinned_host"]  # device: as JAX's own CPU devices
    assert [list(memories[m].device_ids) for m in (5, 13, 21)] == [[5]] * 3
    assert "slice 1 s1" in d.debug_string


class _FakeClient:
    """What a session asks of its ``Client``: only ``describe`` and ``close``."""

    closed = False
    counters = {"put_bytes": 0, "fetched_bytes": 0, "fetches": 0}

    def describe(self):
        return [{**d, "topology": "v6e-2x2", "chips": 4} for d in _described()]

    def close(self):
        self.closed = True


def test_a_session_answers_every_request_and_names_what_it_does_not_serve():
    client = _FakeClient()
    session = Session(1, 25, lambda: client)
    init = session.handle(ifrt_pb2.IfrtRequest(
        request_metadata=ifrt_pb2.RequestMetadata(op_id=1), init_request={}))
    assert init.response_metadata.op_id == 1 and len(init.init_response.all_devices) == 8
    poll = session.handle(ifrt_pb2.IfrtRequest(
        request_metadata=ifrt_pb2.RequestMetadata(op_id=2),
        loaded_host_callback_poll_request={}))
    assert poll.response_metadata.op_id == 2
    assert poll.response_metadata.status.code == UNIMPLEMENTED
    assert "loaded_host_callback_poll_request" in poll.response_metadata.status.message
    # Another session's (or a made-up) handle is unknown here, by name.
    fetch = session.handle(ifrt_pb2.IfrtRequest(
        request_metadata=ifrt_pb2.RequestMetadata(op_id=3),
        copy_to_host_buffer_request={"array_handle": 12345, "host_buffer_handle": 7}))
    assert fetch.response_metadata.status.code == NOT_FOUND
    assert "unknown array handle 12345" in fetch.response_metadata.status.message
    session.close()
    assert client.closed


def test_a_session_whose_slices_cannot_be_had_says_why():
    def no_slices():
        raise RuntimeError("no free TPU slice in the cluster to reserve")

    resp = Session(2, 25, no_slices).handle(ifrt_pb2.IfrtRequest(
        request_metadata=ifrt_pb2.RequestMetadata(op_id=1), init_request={}))
    assert resp.response_metadata.status.code != 0
    assert "no free TPU slice" in resp.response_metadata.status.message


def test_a_program_for_more_devices_than_the_session_has_is_refused_by_name():
    """A compile whose device assignment names 16 devices, in a session of 8: the
    error names the device and the session's range, before anything reaches a chip."""
    from pathways_ray.proxy.protos import xla_python_pjrt_ifrt_xla_compiler_pb2 as xc_pb2

    client = _FakeClient()
    session = Session(3, 25, lambda: client)
    session.handle(ifrt_pb2.IfrtRequest(init_request={}))
    options = xc_pb2.XlaCompileOptionsProto()
    assignment = options.compile_options.executable_build_options.device_assignment
    assignment.replica_count, assignment.computation_count = 1, 16
    for d in range(16):
        assignment.computation_devices.add().replica_device_ids.append(d)
    request = ifrt_pb2.IfrtRequest(request_metadata=ifrt_pb2.RequestMetadata(op_id=9))
    request.compile_request.program.data = b"not even looked at"
    request.compile_request.compile_options.data = options.SerializeToString()
    resp = session.handle(request)
    assert resp.response_metadata.status.code == INVALID_ARGUMENT
    assert ("the program is for device 8; this session has 8 devices (0..7)"
            in resp.response_metadata.status.message)
    session.close()


def _colocated(session: Session, device_ids, kind="jax_colocated_python_v0.0.1", op_id=9):
    """Compile a colocated Python program over ``device_ids`` (a float32[8] in and out)."""
    from pathways_ray.proxy.protos import xla_python_ifrt_array_spec_pb2 as spec_pb2
    from pathways_ray.proxy.protos import xla_python_ifrt_custom_call_program_pb2 as cc_pb2
    from pathways_ray.proxy.types import dtype_proto, hlo_sharding_proto

    spec = spec_pb2.ArraySpecProto(dtype=dtype_proto(np.float32),
                                   sharding=hlo_sharding_proto(device_ids, None))
    spec.shape.dims.append(8)
    program = cc_pb2.CustomCallProgramProto(
        type=kind, name="scale", serialized_program_text=b"(never unpickled by the proxy)",
        input_specs=[spec], output_specs=[spec])
    program.devices.device_ids.extend(device_ids)
    return session.handle(ifrt_pb2.IfrtRequest(
        request_metadata=ifrt_pb2.RequestMetadata(op_id=op_id),
        compile_request={"program": {"type_name": "xla::ifrt::CustomCallProgram",
                                     "data": program.SerializeToString()}}))


def test_colocated_python_is_compiled_for_one_hosts_devices_only_where_the_server_allows(
        monkeypatch):
    """Refused by a server not started with --colocated-python (it runs the client's
    pickles on the hosts); then refused by name for another custom call or devices of
    two hosts; compiled for one host's devices, whose chips say they are their own
    colocated CPU devices (``colocation_id``)."""
    from pathways_ray.proxy.errors import PERMISSION_DENIED
    from pathways_ray.proxy.plugins.colocated import COLOCATED_ENV

    client = _FakeClient()
    session = Session(4, 25, lambda: client)
    init = session.handle(ifrt_pb2.IfrtRequest(init_request={}))
    assert [d.attributes.attributes["colocation_id"].int64_value
            for d in init.init_response.all_devices] == list(range(8))
    monkeypatch.delenv(COLOCATED_ENV, raising=False)
    refused = _colocated(session, [4, 5, 6, 7]).response_metadata.status
    assert refused.code == PERMISSION_DENIED and "--colocated-python" in refused.message
    monkeypatch.setenv(COLOCATED_ENV, "1")
    other = _colocated(session, [4, 5, 6, 7], kind="my_custom_call").response_metadata.status
    assert other.code == UNIMPLEMENTED and "'my_custom_call'" in other.message
    both = _colocated(session, [0, 1, 2, 3, 4, 5, 6, 7]).response_metadata.status
    assert both.code == UNIMPLEMENTED and "2 TPU hosts (s0/0, s1/0)" in both.message
    outside = _colocated(session, [9]).response_metadata.status
    assert outside.code == INVALID_ARGUMENT and "device 9" in outside.message
    ok = _colocated(session, [4, 5, 6, 7])
    assert ok.response_metadata.status.code == 0, ok.response_metadata.status.message
    assert list(ok.compile_response.device_ids) == [4, 5, 6, 7]
    assert ok.compile_response.name == "scale"
    session.close()


TPU_DEVICES = """
import json, jax, pathwaysutils
pathwaysutils.initialize()
from jax.experimental import colocated_python as cp
devices = jax.devices()
everything = devices[0].client._get_all_devices()
cpus = cp.colocated_cpu_devices(devices[4:8])
print("RESULT", json.dumps({
    "devices": [[d.id, d.device_kind] for d in devices],
    "all": len(everything), "cpus": [[d.id, d.device_kind] for d in cpus],
    "memories": sorted(m.kind for m in cpus[0].addressable_memories())}), flush=True)
"""


def test_on_tpu_slices_each_chip_has_a_cpu_device_that_colocated_python_finds():
    """jaxlib's own client against a session of two TPU slices (a stand-in client:
    nothing here reaches a chip): jax.devices() is the 8 chips, and
    colocated_cpu_devices of slice 1's chips is their own CPU devices, ids 12..15."""
    import json
    import os

    from pathways_ray.proxy.server import ProxyServer

    class _TpuClient(_FakeClient):
        def describe(self):
            return [{**d, "topology": "v6e-2x2", "chips": 4} for d in _described("tpu")]

    devices = plan_devices(_described("tpu"))
    assert [(d.id, d.platform, d.colocation_id) for d in devices[8:10]] == [
        (8, "cpu", 0), (9, "cpu", 1)]
    resp = init_response(1, devices)
    assert list(resp.primary_device_ids) == list(range(8))
    assert list(resp.addressable_device_ids) == list(range(16))
    with ProxyServer([]) as server:
        server.clients._connect = lambda **kw: _TpuClient()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))}
        out = subprocess.run([sys.executable, "-c", TPU_DEVICES], capture_output=True,
                             text=True, timeout=120, env={**env, **server.exports})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(ln for ln in out.stdout.splitlines()
                          if ln.startswith("RESULT")).removeprefix("RESULT"))
    assert got["devices"] == [[i, "TPU v6 lite"] for i in range(8)]
    assert got["all"] == 16
    assert got["cpus"] == [[i, "cpu"] for i in range(12, 16)]
    assert got["memories"] == ["device", "pinned_host", "unpinned_host"]
