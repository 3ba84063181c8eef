"""A new user's first hour, end to end, on the smallest fleet: `pathways-ray up`, then
a fresh process with only the printed exports runs `pathways_ray.connect()` (no
`Fleet.attach()`), a program on its slice, and a lease of a shared service.

This is the fast tier's one fleet test (`./run.sh test --fast`): if it passes, the
CLI, Ray's token auth, reservation, chip workers, the controller and the service
all still work together.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import leftovers, ray_processes

pytestmark = [pytest.mark.slow, pytest.mark.smoke]

CLI = [sys.executable, "-m", "pathways_ray.cli.main"]
NAME = "tsmoke"

_CONNECT = """
import logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import pathways_ray as pr
from jax.sharding import PartitionSpec as P
service = sys.argv[1] if len(sys.argv) > 1 else None
client = (pr.connect(service=service, slices={"v6e-2x2": 1}) if service
          else pr.connect(["v6e-2x2"]))
with client:
    mesh = client.mesh((2, 2), ("data", "model"))
    from jax.sharding import NamedSharding
    x = client.device_put(np.arange(16, dtype=np.float32).reshape(4, 4),
                          NamedSharding(mesh, P("data", "model")))
    y = client.jit(lambda a: (a * 2).sum(axis=0))(x)
    print("slices", [s.topology for s in client.slices], "sum", y.fetch().tolist())
"""


def _env(exports: dict[str, str] | None) -> dict[str, str]:
    """This machine's environment less every Ray setting, plus ``exports``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.pop("PATHWAYS_RAY_FLEET", None)
    return {**env, **(exports or {})}


def _run(args: list[str], exports=None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s,
                          env=_env(exports))


@pytest.fixture(scope="module")
def exports():
    """A fleet started as a user starts one; the `export K=V` lines it printed."""
    before = ray_processes()
    up = _run(CLI + ["up", "--slices", "2", "--accelerator", "v6e", "--topology", "2x2",
                     "--name", NAME])
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        lines = [ln.strip()[len("export "):] for ln in up.stdout.splitlines()
                 if ln.strip().startswith("export ")]
        found = dict(line.split("=", 1) for line in lines)
        assert {"RAY_ADDRESS", "RAY_AUTH_MODE"} <= set(found), up.stdout
        yield found
    finally:
        down = _run(CLI + ["down", "--name", NAME])
        assert down.returncode == 0, down.stdout + down.stderr
        assert leftovers(before) == []


def test_connect_finds_the_cluster_from_the_exports_alone(exports):
    """`connect()` in a fresh process attaches to $RAY_ADDRESS by itself, says so in one
    log line, and runs a program on the slice it reserved."""
    out = _run([sys.executable, "-c", _CONNECT], exports)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "slices ['v6e-2x2'] sum [48.0, 56.0, 64.0, 72.0]" in out.stdout, out.stdout
    said = [ln for ln in out.stderr.splitlines() if "connecting to the Ray cluster at" in ln]
    assert len(said) == 1 and exports["RAY_ADDRESS"] in said[0], out.stderr


def test_connect_to_a_service_from_the_exports_alone(exports):
    """The README's shared-service snippet, verbatim, in a process with only the exports
    set: the service started from the CLI lends it a slice."""
    start = _run(CLI + ["service", "start", "--name", "smoke", "--slices", "v6e-2x2",
                        "--fleet", NAME], exports)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        out = _run([sys.executable, "-c", _CONNECT, "smoke"], exports)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "sum [48.0, 56.0, 64.0, 72.0]" in out.stdout, out.stdout
    finally:
        stop = _run(CLI + ["service", "stop", "--name", "smoke"], exports)
        assert stop.returncode == 0, stop.stdout + stop.stderr


def test_with_nothing_set_the_error_says_how_to_connect():
    """No $RAY_ADDRESS and no cluster: the clear error, naming what to set, and no
    cluster started behind the user's back."""
    out = _run([sys.executable, "-c", "import pathways_ray as pr; pr.connect()"], {})
    assert out.returncode == 1
    assert "RuntimeError: not connected to a Ray cluster and $RAY_ADDRESS is not set" in \
        out.stderr, out.stderr
    assert "pathways-ray up" in out.stderr


def test_the_readme_example_runs_as_written(exports):
    """The README's one example, verbatim, on the fleet `up` started (through
    `cluster_or_local`, as a user on a real cluster would run it)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = readme.split("## One example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    out = _run([sys.executable, "-c", code], exports)
    assert out.returncode == 0, out.stdout + out.stderr
    loss, moved = out.stdout.strip().splitlines()[-2:]
    assert abs(float(loss) - np.tanh(512.0)) < 1e-6, out.stdout
    assert moved.split()[0] != "" and float(moved.split()[1]) == 512 * 512, out.stdout


_DEVICES = """
import os
import jax, pathwaysutils
from jax.extend import backend
from jax.extend.backend import ifrt_proxy
pathwaysutils.initialize()

def _proxy_client():  # as docs/unmodified-jax.md shows, to present the token
    options = ifrt_proxy.ClientConnectionOptions()
    options.initialization_data = {
        "pathways_ray_token": os.environ["PATHWAYS_RAY_PROXY_TOKEN"].encode()}
    return ifrt_proxy.get_client(jax.config.read("jax_backend_target"), options)

backend.register_backend_factory("proxy", _proxy_client, priority=-1)
print("devices", len(jax.devices()), sorted({d.slice_index for d in jax.devices()}))
"""


def test_the_proxy_command_serves_plain_jax_and_sigterm_stops_it(exports):
    """`pathways-ray proxy` on the fleet `up` started: it prints the exports, a plain JAX
    script with only those sees its session's chips, and SIGTERM (what Kubernetes
    sends) stops the server and its sessions like Ctrl-C. Its token comes from
    $PATHWAYS_RAY_PROXY_TOKEN, as a Kubernetes Secret hands it over."""
    import signal
    import threading
    import time

    token = "from-a-kubernetes-secret"
    proc = subprocess.Popen(CLI + ["proxy", "--slices", "v6e-2x2:1", "--fleet", NAME],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**_env(exports), "PATHWAYS_RAY_PROXY_TOKEN": token})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS" in ln for ln in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        proxy = dict(ln.strip()[len("export "):].split("=", 1) for ln in lines
                     if ln.strip().startswith("export "))
        assert proxy["PATHWAYS_RAY_PROXY_TOKEN"] == token
        env = {k: v for k, v in _env(None).items() if not k.startswith(("JAX_", "XLA_"))}
        out = subprocess.run([sys.executable, "-c", _DEVICES], capture_output=True, text=True,
                             timeout=300, env={**env, **proxy})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "devices 4 [0]" in out.stdout, out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130, "".join(lines)
        reader.join(timeout=10)
        assert "interrupted" in "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
