"""Unmodified JAX through the IFRT proxy (``pathways_ray.proxy``), step 1: sessions and
devices. A plain JAX script, no ``pathways_ray`` import, only environment variables
and ``pathwaysutils.initialize()``, sees one device per chip of 2 emulated v6e 2x2
slices; what is not served yet fails with a named error, and the server keeps
serving."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from pathways_ray.proxy import versions
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

PLAIN_JAX = """
import json, sys
import jax
import pathwaysutils
pathwaysutils.initialize()
devices = jax.devices()
print(json.dumps({"backend": jax.default_backend(), "n": len(devices),
                  "slices": [d.slice_index for d in devices],
                  "kinds": sorted({d.device_kind for d in devices}),
                  "coords": [list(d.coords) for d in devices[:4]]}))
sys.stdout.flush()
if sys.argv[1:] == ["put"]:
    import numpy as np
    try:
        jax.device_put(np.ones(4, np.float32), devices[0]).block_until_ready()
    except Exception as e:
        print("ERROR", type(e).__name__, e)
"""


@pytest.fixture(scope="module")
def proxy():
    from pathways_ray import LocalFleet
    from pathways_ray.proxy.server import ProxyServer

    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="tproxy",
                    log_to_driver=False):
        server = ProxyServer(["v6e-2x2", "v6e-2x2"])
        server.start()
        try:
            yield server
        finally:
            server.stop()  # waits for a session still closing as its script exits
            assert server.sessions == 0
    # Nothing of a session outlived the fleet: a client closed after it would have
    # re-connected this process to the dead cluster (seen: every later fleet failed).
    import ray

    assert not ray.is_initialized()


def _plain_jax(server, *args, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run the plain JAX script as a user would: only the server's exports set, no
    Ray settings (the script never talks to Ray)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))}
    env.update(server.exports, PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="60")
    return subprocess.run([sys.executable, "-c", PLAIN_JAX, *args], capture_output=True,
                          text=True, timeout=timeout_s, env=env)


def test_plain_jax_sees_one_device_per_chip_of_both_slices(proxy):
    import json

    out = _plain_jax(proxy)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["backend"] == "cpu"  # the emulated chips' own platform: JAX lowers for it
    assert seen["n"] == 8 and seen["slices"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert seen["kinds"] == ["cpu"]
    assert seen["coords"] == [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
    # The session's slices go back when the script ends.
    wait_until(lambda: proxy.sessions == 0, 60, "the session did not close after its script")


def test_what_is_not_served_yet_fails_by_name_and_the_server_keeps_serving(proxy):
    out = _plain_jax(proxy, "put")
    assert out.returncode == 0, out.stdout + out.stderr
    error = next(ln for ln in out.stdout.splitlines() if ln.startswith("ERROR"))
    assert "JaxRuntimeError" in error or "XlaRuntimeError" in error, error
    # The put itself is asynchronous; the first call that waits on it reports the error.
    assert "UNIMPLEMENTED" in error and "does not serve" in error, error
    again = _plain_jax(proxy)
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_client_outside_the_protocol_versions_is_refused_naming_both_ranges(proxy):
    """A client speaking only versions 3..5 gets FAILED_PRECONDITION naming 3..5 and
    16..25; the server answers the next client as before."""
    from pathways_ray.proxy.protos import (
        xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2 as grpc_pb2,
    )
    from pathways_ray.proxy.protos import (
        xla_python_ifrt_proxy_common_grpc_ifrt_service_pb2_grpc as grpc_service,
    )
    from pathways_ray.proxy.protos import (
        xla_python_ifrt_proxy_common_ifrt_service_pb2 as ifrt_pb2,
    )

    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        stub = grpc_service.GrpcIfrtServiceStub(channel)

        def ask(low, high):
            return stub.GetVersion(grpc_pb2.GrpcGetVersionRequest(
                min_version=ifrt_pb2.IfrtProxyVersion(protocol_version=low),
                max_version=ifrt_pb2.IfrtProxyVersion(protocol_version=high)), timeout=10)

        with pytest.raises(grpc.RpcError) as refused:
            ask(3, 5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "3..5" in refused.value.details()
        assert f"{versions.MIN_VERSION}..{versions.MAX_VERSION}" in refused.value.details()
        assert ask(16, 30).version.protocol_version == versions.MAX_VERSION
