"""Unmodified JAX through the IFRT proxy (``pathways_ray.proxy``) on 2 emulated v6e 2x2
slices. Plain JAX scripts (``proxy_scripts.py``: no ``pathways_ray`` import, only
environment variables and ``pathwaysutils.initialize()``) see one device per chip,
train with the losses of 4 local CPU devices while another program runs on the other
slice, move an array between slices chip to chip, and meet a killed host as
``DATA_LOSS`` naming the slice; bad input fails by name and the server keeps serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from pathways_ray.proxy import versions
from pathways_ray.proxy.plugins.colocated import COLOCATED_ENV
from tests import proxy_scripts
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
"""


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    from pathways_ray import LocalFleet
    from pathways_ray.config import STORAGE_ENV
    from pathways_ray.proxy.server import ProxyServer

    with pytest.MonkeyPatch.context() as env, LocalFleet(
            num_slices=2, accelerator="v6e", topology="2x2", name="tproxy",
            log_to_driver=False) as fleet:
        # The chips may write and read under the tests' own directories (and buckets).
        env.setenv(STORAGE_ENV, f"gs://,{tmp_path_factory.getbasetemp()}")
        env.setenv(COLOCATED_ENV, "1")  # (pathways-ray proxy --colocated-python)
        server = ProxyServer(["v6e-2x2", "v6e-2x2"], warm=True)
        server.fleet = fleet
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


def _env(server=None) -> dict:
    """A user's environment: the server's exports only (the script never talks to
    Ray), or without a server 4 local CPU devices, the reference run."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))}
    if server is None:
        return {**env, "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    return {**env, **server.exports, "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS": "60"}


def _plain_jax(server, *args, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PLAIN_JAX, *args], capture_output=True,
                          text=True, timeout=timeout_s, env=_env(server))


def _script(source: str, server=None, timeout_s: float = 300, env: dict | None = None,
            args: tuple[str, ...] = ()) -> dict:
    out = subprocess.run([sys.executable, "-c", source, *args], capture_output=True,
                         text=True, timeout=timeout_s, env={**_env(server), **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


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


WARM = """
import json, time
import numpy as np
import jax, pathwaysutils
pathwaysutils.initialize()
t0 = time.perf_counter()
devices = jax.devices()
init_s = time.perf_counter() - t0
kept = [jax.device_put(np.full(1000, float(i)), devices[i]) for i in range(8)]  # not deleted
y = jax.jit(lambda a: a * 2)(kept[3])
print("RESULT", json.dumps({"init_s": init_s, "y": float(y.sum())}), flush=True)
"""


def test_sessions_one_after_another_take_the_chips_up_already_and_leave_them_empty(proxy):
    """The server made a client (slices reserved, chip workers up) when it started;
    a session takes it, and at its end hands it on to the next with every array it
    left freed on the chips (counted there: kept only when no chip holds a buffer).
    No session of these connects a client of its own."""
    wait_until(lambda: proxy.sessions == 0, 60, "an earlier session did not close")
    before = dict(proxy.clients.counts)
    for _ in range(2):
        got = _script(WARM, proxy)
        assert got["y"] == 6000.0
        wait_until(lambda: proxy.sessions == 0, 60, "the session did not close")
    took = {k: proxy.clients.counts[k] - before[k] for k in before}
    assert took["taken_warm"] == 2 and took["connected_cold"] == 0, took
    assert took["kept"] == 2 and took["closed"] == 0, took
    assert proxy.clients._ready is not None  # waiting for the next session


def test_a_plain_jax_training_script_runs_unchanged_with_local_losses(proxy):
    """20 jit steps with NamedSharding on slice 0's mesh give the losses of the same
    script on 4 local CPU devices; another program runs on slice 1 meanwhile; a 4 MiB
    array made on slice 0 goes to slice 1 chip to chip: not one of its bytes passes
    through the proxy."""
    before = proxy.stats()
    got = _script(proxy_scripts.TRAIN, proxy)
    after = proxy.stats()
    want = _script(proxy_scripts.TRAIN)
    assert got["n"] == 8 and got["slices"] == [0, 0, 0, 0, 1, 1, 1, 1]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["z"], want["z"], rtol=1e-6)
    assert got["step_on"] == [0, 1, 2, 3] and got["z_on"] == [4, 5, 6, 7]
    assert got["moved_on"] == [4, 5, 6, 7] and got["total"] == want["total"]
    through = {k: after[k] - before[k] for k in after}
    assert through["sessions"] == 1
    # The script's own puts and reads are a few KiB; the 4 MiB array is not among them.
    assert through["host_bytes_in"] + through["host_bytes_out"] < 64 << 10, through
    assert through["put_bytes"] + through["fetched_bytes"] < 64 << 10, through


def test_a_sharded_array_read_shard_by_shard_is_fetched_from_the_chips_once(proxy):
    """jax reads a sharded array one shard at a time (a copy to the host per shard, all
    at once): the four reads of a 4 MiB array on four chips share one fetch of it,
    not four (16 MiB) racing each other."""
    before = proxy.stats()
    got = _script(proxy_scripts.PREAMBLE + """
big = jax.jit(lambda: jnp.arange(1 << 20, dtype=jnp.float32).reshape(1024, 1024),
              out_shardings=NamedSharding(mesh0, P("data")))()
print("RESULT", json.dumps({"total": float(np.asarray(big).sum())}), flush=True)
""", proxy)
    after = proxy.stats()
    assert got["total"] == float(np.arange(1 << 20, dtype=np.float32).sum())
    fetched = after["fetched_bytes"] - before["fetched_bytes"]
    assert 4 << 20 <= fetched < (4 << 20) + (64 << 10), fetched


# A train step as MaxText's: its state donated to the next step, its metrics read one
# scalar at a time after the next step is on its way.
METRICS = proxy_scripts.PREAMBLE + """
rep = NamedSharding(mesh0, P())
def train(state, x):
    w, n = state
    f = lambda w: jnp.mean((x @ w) ** 2)
    loss, g = jax.value_and_grad(f)(w)
    return (w - 0.01 * g, n + 1), {"loss": loss, "gnorm": jnp.linalg.norm(g), "n": n,
                                    "wmax": w.max(), "wmin": w.min(), "gsum": g.sum()}
run = jax.jit(train, donate_argnums=0)
state = (jax.device_put(np.full((16, 16), 0.1, np.float32), rep), jax.device_put(np.int32(0), rep))
seen, last = [], None
for i in range(6):
    state, metrics = run(state, jax.device_put(X + i, NamedSharding(mesh0, P("data"))))
    if last is not None:
        seen.append({k: float(v) for k, v in last.items()})
    last = metrics
seen.append({k: float(v) for k, v in last.items()})
print("RESULT", json.dumps({"seen": seen}), flush=True)
"""


def test_a_steps_scalar_metrics_read_one_by_one_come_from_the_chips_together(proxy):
    """MaxText reads a step's metrics one scalar at a time: the first read brings the
    step's other small results along (one fetch, not six), while its small state,
    donated to the next step meanwhile, stays behind without failing any read. The
    values are local JAX's."""
    before = proxy.stats()["fetches"]
    got = _script(METRICS, proxy)["seen"]
    fetches = proxy.stats()["fetches"] - before
    want = _script(METRICS)["seen"]
    assert [m["n"] for m in got] == list(range(6))
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys() and all(np.isclose(g[k], w[k], rtol=1e-5) for k in g), (g, w)
    assert fetches <= 6 + 2, fetches  # one per step (36 reads), and the device_puts' none


# A batch made on one device, then spread over the mesh (jax copies its slices to their
# devices and assembles them), as MaxText's synthetic data is; and one whose program failed.
SPREAD = proxy_scripts.PREAMBLE + """
one = jax.device_put(np.float32(1.0), devices[0])
make = jax.jit(lambda i: jnp.arange(256 * 64, dtype=jnp.float32).reshape(256, 64) * i)
use = jax.jit(lambda a, b: (jnp.sum(a * jnp.arange(64.0)), jnp.sum(b[::3] * 2)))
sums = []
for i in range(3):
    batch = make(one + i)
    a = jax.device_put(batch, NamedSharding(mesh0, P("data")))
    b = jax.device_put(batch, NamedSharding(mesh0, P()))
    sums.append([float(v) for v in use(a, b)])
# Parts of arrays over two meshes (one program cannot take both): by the proxy, as before.
on = lambda a, d: next(s.data for s in a.addressable_shards if s.device == devices[d])
r0 = jax.device_put(np.array([[1.0, 2.0]], np.float32), NamedSharding(mesh0, P()))
r1 = jax.device_put(np.array([[3.0, 4.0]], np.float32),
                    NamedSharding(Mesh(np.array(devices[:4]).reshape(2, 2), ("x", "y")), P()))
mixed = jax.make_array_from_single_device_arrays(
    (4, 2), NamedSharding(mesh0, P("data")), [on(r0, 0), on(r1, 1), on(r0, 2), on(r1, 3)])
sums.append(np.asarray(mixed * 2).tolist())
error = None
if PROXY:  # (a sort of 256 GiB: no fusing it away, no machine holds it)
    bad = jax.jit(lambda i: jnp.sort(jnp.arange(1 << 36, dtype=jnp.float32) * i)[:8])(one)
    try:
        np.asarray(jax.device_put(bad, NamedSharding(mesh0, P("data"))))
    except Exception as e:
        error = str(e)
print("RESULT", json.dumps({"sums": sums, "error": error}), flush=True)
"""


def test_a_batch_made_on_one_device_spreads_over_the_mesh_on_the_chips(proxy):
    """A ``device_put`` of a one-device array onto a sharded or replicated mesh is
    made on the chips (its copies to the other devices and their assembly): no byte
    of the 64 KiB batches comes to the proxy, and the values are local JAX's. A batch
    whose program failed raises its error where it is read, not a hang."""
    before = proxy.stats()
    got = _script(SPREAD, proxy)
    fetched = proxy.stats()["fetched_bytes"] - before["fetched_bytes"]
    want = _script(SPREAD)
    assert got["sums"] == want["sums"] and got["sums"][2][0] > 0
    assert got["sums"][3] == [[2, 4], [6, 8], [2, 4], [6, 8]]
    assert fetched < 1024, fetched  # the sums only (3 x 64 KiB batches before)
    assert "Out of memory allocating 274877906944 bytes" in got["error"], got["error"]


# Runs a module as ``python -m`` would, after the one line a pathwaysutils user adds.
RUN_MODULE = ("import pathwaysutils, runpy, sys; pathwaysutils.initialize(); "
              "name = sys.argv[1]; sys.argv = [name]; "
              "runpy.run_module(name, run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize("module,tests", [("optax._src.combine_test", 15)])
def test_optax_own_test_modules_run_unmodified(proxy, module, tests, tmp_path):
    """Optax's published tests (in its wheel): ``combine_test`` chains transformations,
    names them and partitions optimizers over parameter labels (``update_test`` passes
    too, 6 tests; one module keeps CI short). Every array and program of
    them runs on the session's chips (one-device programs on slice 0's)."""
    before = proxy.stats()["sessions"]
    out = subprocess.run([sys.executable, "-c", RUN_MODULE, module], capture_output=True,
                         text=True, timeout=300, env=_env(proxy), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"Ran {tests} tests" in out.stderr and "\nOK" in out.stderr, out.stderr[-4000:]
    assert proxy.stats()["sessions"] == before + 1


def test_arrays_and_programs_across_both_slices_give_local_values(proxy):
    """The session's two slices are one JAX world: a hybrid mesh over both (as
    ``mesh_utils.create_hybrid_device_mesh`` makes it from ``slice_index``), a program
    over it, its shards and their assembly, a copy to one slice and back, and a data
    parallel step, each equal to 8 local CPU devices; and the compiled program's
    ``memory_analysis()`` (a chip's argument and result bytes), as XLA says it locally."""
    got = _script(proxy_scripts.ACROSS, proxy)
    want = _script(proxy_scripts.ACROSS, env={"XLA_FLAGS":
                                              "--xla_force_host_platform_device_count=8"})
    assert got["slices"] == [0, 1]
    for key in ("y", "again", "back"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
    np.testing.assert_allclose([got["total"], got["dp"]], [want["total"], want["dp"]],
                               rtol=1e-5)
    assert got["parts"] == want["parts"] and got["on0"] == [0, 1, 2, 3]
    assert got["mem"] == want["mem"] and got["mem"][0] == 64 * 4 * 4 // 8


# Runs a published example file as it is, after what a pathwaysutils user adds (and a
# seed for numpy's global generator, which the example draws its data from).
RUN_FILE = ("import numpy, os, runpy, sys; numpy.random.seed(0)\n"
            "if os.environ.get('JAX_PLATFORMS') == 'proxy':\n"
            "    import pathwaysutils; pathwaysutils.initialize()\n"
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def test_flax_data_parallel_example_runs_across_both_slices_with_local_losses(proxy):
    """Flax's published ``nnx_toy_examples/04_data_parallel_with_jit.py`` (from the
    flax 0.12.8 sdist, run as published) shards over all ``jax.local_device_count()``
    devices, so its mesh spans both slices: it trains 1,000 steps through the proxy and
    prints the losses it prints on 8 local CPU devices."""
    from tests.client_envs import published_file

    example = published_file("flax==0.12.8",
                             "examples/nnx_toy_examples/04_data_parallel_with_jit.py")

    def losses(server) -> list[float]:
        env = {**_env(server), "MPLBACKEND": "Agg"}
        out = subprocess.run([sys.executable, "-c", RUN_FILE, str(example)],
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return [float(ln.split("loss=")[1]) for ln in out.stdout.splitlines()
                if ln.startswith("step=")]

    got, want = losses(proxy), losses(None)
    assert len(got) == len(want) == 10
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_ten_thousand_steps_queued_without_a_sync_lose_nothing(proxy):
    """10,000 steps of 2 puts (NumPy batches handed to a jit) and 1 program, queued by
    jaxlib's client with no sync until the end: every host buffer store of the burst
    is taken (none cancelled, the session not dropped) and every step ran, in order."""
    n = 10_000
    got = _script(proxy_scripts.BURST.replace("sys.argv[1]", str(n)), proxy, timeout_s=900)
    xs = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    want = sum(float(np.sum(xs[i % 64] * xs[(7 * i + 1) % 64])) for i in range(n))
    assert got["count"] == n
    np.testing.assert_allclose(got["acc"], want, rtol=1e-4)
    assert got["queued_s"] < got["s"]


@pytest.mark.parametrize("name", ["02_lifted_transforms.py", "03_train_state.py"])
def test_flax_toy_examples_of_ten_thousand_steps_run_unmodified_with_local_losses(proxy, name):
    """Flax's published ``nnx_toy_examples/02`` and ``03`` (flax 0.12.8 sdist, as
    published, no client variable set): 10,000 steps, each with a NumPy batch put
    from the host, losses printed every 1,000; they died mid-run before the server held
    a burst's host-buffer stores. The losses and the count are local JAX's."""
    from tests.client_envs import published_file

    example = published_file("flax==0.12.8", f"examples/nnx_toy_examples/{name}")

    def run(server) -> list[str]:
        out = subprocess.run([sys.executable, "-c", RUN_FILE, str(example)],
                             capture_output=True, text=True, timeout=900, env=_env(server))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return [ln for ln in out.stdout.splitlines() if ln.startswith(("step:", "times"))]

    got, want = run(proxy), run(None)
    assert len(got) == len(want) == 11 and got[-1] == want[-1], (got, want)
    np.testing.assert_allclose([float(ln.rsplit(":", 1)[1]) for ln in got[:-1]],
                               [float(ln.rsplit(":", 1)[1]) for ln in want[:-1]], rtol=1e-5)


def test_a_host_callback_is_refused_by_name_and_the_session_goes_on(proxy, monkeypatch):
    """A host callback, and colocated Python on a server not started to run it."""
    monkeypatch.delenv(COLOCATED_ENV)
    out = subprocess.run([sys.executable, "-c", proxy_scripts.CALLBACK], capture_output=True,
                         text=True, timeout=240, env=_env(proxy))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    callback = json.loads(next(ln for ln in out.stdout.splitlines()
                               if ln.startswith("CALLBACK")).removeprefix("CALLBACK"))
    assert callback["type"] == "JaxRuntimeError", callback
    assert "UNIMPLEMENTED" in callback["error"] and "host callback" in callback["error"]
    colocated = json.loads(next(ln for ln in out.stdout.splitlines()
                                if ln.startswith("COLOCATED")).removeprefix("COLOCATED"))
    assert colocated["type"] == "JaxRuntimeError", colocated
    assert "PERMISSION_DENIED" in colocated["error"], colocated
    assert "--colocated-python" in colocated["error"], colocated
    assert any(ln.startswith("OK") for ln in out.stdout.splitlines())


def test_colocated_python_runs_on_the_host_of_its_devices_with_local_values(proxy):
    """``jax.experimental.colocated_python`` (``--colocated-python``): a function on
    each slice's colocated CPU devices runs in that slice's host sidecar (its TPU_NAME
    comes back) with the values of local JAX, first call and after; a class keeps its
    state on the host; its result moves to the chips and into a jit. A function over two
    hosts' devices and one that raises fail by name; the session goes on."""
    got = _script(proxy_scripts.COLOCATED, proxy)
    want = _script(proxy_scripts.COLOCATED)
    hosts = {k: got["out"].pop(k) for k in ("host0", "host1", "on0", "on1")}
    for k in ("host0", "host1", "on0", "on1"):
        want["out"].pop(k)
    assert got["out"] == want["out"]
    # state on the host, its calls run in the order made
    assert got["out"]["counter"] == [[float(n)] * 4 for n in range(1, 6)]
    assert got["out"]["batches"] == [[float(n)] * 4 for n in range(4)]  # none taken twice
    assert hosts == {"host0": "v6e-2x2-0", "host1": "v6e-2x2-1", "on0": [0, 1, 2, 3],
                     "on1": [4, 5, 6, 7]}
    assert "UNIMPLEMENTED" in got["errors"]["both"] and "2 TPU hosts" in got["errors"]["both"]
    assert want["errors"]["boom"] == "this shard is corrupt"
    assert ("colocated_python(boom) on host v6e-2x2-0/0 failed: ValueError: this shard is "
            "corrupt") in got["errors"]["boom"], got["errors"]


def test_orbax_with_pathways_persistence_writes_and_reads_on_the_chips(proxy, tmp_path):
    """``ENABLE_PATHWAYS_PERSISTENCE=1``: Orbax's ``StandardCheckpointer`` saves a train
    state made on slice 0 (4 MiB of it one array) and restores it onto slice 0 and onto
    slice 1, equal, with the local run's values; the chips write and read every byte
    (none passes through the proxy) as TensorStore arrays at ``<checkpoint>/<name>``. A
    write outside the server's storage roots, one the hosts cannot write and a read of an
    array that is not there fail by name; the session goes on."""
    import tensorstore as ts

    before = proxy.stats()
    got = _script(proxy_scripts.PERSIST, proxy, env={"ENABLE_PATHWAYS_PERSISTENCE": "1"},
                  args=(str(tmp_path / "ckpt"),))
    after = proxy.stats()
    want = _script(proxy_scripts.PERSIST, args=(str(tmp_path / "local"),),
                   env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert got["same"] and got["other"] and got["other_on"] == [4, 5, 6, 7]
    assert got["specs"] == want["specs"] and got["sums"] == pytest.approx(want["sums"])
    through = {k: after[k] - before[k] for k in after}
    assert through["host_bytes_in"] + through["host_bytes_out"] < 64 << 10, through
    assert through["put_bytes"] + through["fetched_bytes"] < 64 << 10, through
    assert {"w", "h", "b", "step", "_METADATA"} <= set(got["files"])
    w = ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                                               "path": str(tmp_path / "ckpt" / "w")}}).result()
    assert w.shape == (1024, 1024)
    assert float(np.sum(w.read().result(), dtype=np.float64)) == pytest.approx(
        want["sums"]["w"], rel=1e-5)
    assert "PERMISSION_DENIED" in got["outside"] and "/etc/pathways-ray" in got["outside"]
    assert "JaxRuntimeError" in got["unwritable"] and "a-file/ckpt" in got["unwritable"]
    assert "JaxRuntimeError" in got["missing"] and "nothere" in got["missing"]
    assert got["after"] == pytest.approx(2 * want["sums"]["b"], rel=1e-5)


def test_a_pathwaysutils_profile_traces_every_chip_of_both_slices(proxy, tmp_path):
    """pathwaysutils' profile request starts a trace of the session's chips and
    ``jax.profiler.stop_trace()`` writes it where the request says: one trace, every
    chip of both slices in it with its events, beside the client's own."""
    import gzip

    got = _script(proxy_scripts.PROFILE, proxy, args=(str(tmp_path),))
    assert got["y"] == 4096.0
    runs = sorted((tmp_path / "plugins" / "profile").iterdir())
    traces = [p for r in runs for p in r.glob("pathways.perfetto.json.gz")]
    assert len(traces) == 1 and (traces[0].parent / "pathways.xplane.pb").stat().st_size > 0
    clients = [p for r in runs if r != traces[0].parent for p in r.glob("*.xplane.pb")]
    assert clients  # the client's own JAX trace, beside it
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    chips = {names[e["pid"]] for e in events if e.get("ph") == "X" and "chip" in names[e["pid"]]}
    assert len(chips) == 8 and len({c.split(" chip")[0] for c in chips}) == 2


def test_a_profile_left_running_is_written_at_the_sessions_end_and_frees_the_chips(
        proxy, tmp_path):
    """A client that starts a profile and exits without stopping it: its session stops
    the chips' profilers and writes the trace where it was asked; the next session
    (the same warm client, the same chip workers) profiles as usual."""
    import gzip

    assert _script(proxy_scripts.PROFILE_LEFT, proxy, args=(str(tmp_path / "left"),))
    wait_until(lambda: proxy.sessions == 0, 120, "the profiling session did not close")
    left = list((tmp_path / "left").glob("plugins/profile/*/pathways.perfetto.json.gz"))
    assert len(left) == 1 and json.loads(gzip.decompress(left[0].read_bytes()))["traceEvents"]
    assert _script(proxy_scripts.PROFILE, proxy, args=(str(tmp_path / "next"),))["y"] == 4096.0
    assert list((tmp_path / "next").glob("plugins/profile/*/pathways.perfetto.json.gz"))


def test_pathwaysutils_reshard_moves_a_tree_between_shardings_and_slices(proxy):
    got = _script(proxy_scripts.RESHARD, proxy)
    want = _script(proxy_scripts.RESHARD, env={"XLA_FLAGS":
                                               "--xla_force_host_platform_device_count=8"})
    assert got == want and got["x_on"] == [4, 5, 6, 7] and got["again_on"] == [0, 1, 2, 3]


def test_host_memory_kinds_and_host_offload_in_a_jit_equal_local_jax(proxy):
    """pinned_host and unpinned_host arrays (put, read, moved to the chips, across
    slices, on one device), a jit whose result lands in host memory, offload inside a
    program and remat offload of activations: each equal to local JAX on CPU devices."""
    got = _script(proxy_scripts.MEMORY, proxy)
    want = _script(proxy_scripts.MEMORY, env={"XLA_FLAGS":
                                              "--xla_force_host_platform_device_count=8"})
    assert got == want
    assert got["memories"] == ["device", "pinned_host", "unpinned_host"]
    assert got["kinds"] == ["pinned_host", "device", "unpinned_host", "pinned_host", "device",
                            "device", "pinned_host", "pinned_host"]


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


# The client as a user who passes the proxy's token registers it (in place of
# pathwaysutils.initialize(), which passes no initialization_data).
TOKEN_JAX = """
import json, os
import jax
from jax.extend import backend
from jax.extend.backend import ifrt_proxy

def client():
    options = ifrt_proxy.ClientConnectionOptions()
    # jaxlib's client retries a refused session (once a second) until this timeout
    options.connection_timeout_in_seconds = int(os.environ["CONNECT_TIMEOUT_S"])
    if "PATHWAYS_RAY_PROXY_TOKEN" in os.environ:
        options.initialization_data = {
            "pathways_ray_token": os.environ["PATHWAYS_RAY_PROXY_TOKEN"].encode()}
    return ifrt_proxy.get_client(jax.config.read("jax_backend_target"), options)

backend.register_backend_factory("proxy", client, priority=-1)
try:
    print("RESULT", json.dumps({"n": len(jax.devices())}))
except Exception as e:
    print("RESULT", json.dumps({"error": str(e), "type": type(e).__name__}))
"""


def test_a_session_without_the_token_or_with_another_is_refused_by_name(proxy):
    from pathways_ray.proxy.server import ProxyServer

    with pytest.raises(ValueError, match="host='0.0.0.0' serves the network: give token"):
        ProxyServer(["v6e-2x2"], host="0.0.0.0")
    # The module's server keeps a warm client holding both slices: it lets them go (and
    # keeps no more clients), so that this second server's session can have them.
    wait_until(lambda: proxy.sessions == 0, 60, "an earlier session did not close")
    proxy.clients.close()
    with ProxyServer(["v6e-2x2", "v6e-2x2"], token="t0ken") as guarded:
        assert guarded.exports["PATHWAYS_RAY_PROXY_TOKEN"] == "t0ken"
        env = {k: v for k, v in _env(guarded).items() if k != "PATHWAYS_RAY_PROXY_TOKEN"}

        def run(token, timeout_s=3):
            given = {} if token is None else {"PATHWAYS_RAY_PROXY_TOKEN": token}
            out = subprocess.run([sys.executable, "-c", TOKEN_JAX], capture_output=True,
                                 text=True, timeout=240,
                                 env={**env, **given, "CONNECT_TIMEOUT_S": str(timeout_s)})
            assert out.returncode == 0, out.stderr[-3000:]
            return json.loads(next(ln for ln in out.stdout.splitlines()
                                   if ln.startswith("RESULT")).removeprefix("RESULT"))

        missing = run(None)
        assert "UNAUTHENTICATED" in missing["error"], missing
        assert "present its token" in missing["error"], missing
        wrong = run("guess")
        assert "UNAUTHENTICATED" in wrong["error"] and "not this proxy's" in wrong["error"]
        assert guarded.sessions == 0 and guarded.stats()["sessions"] == 0
        assert run("t0ken", 60) == {"n": 8}  # and the server kept serving


def test_a_killed_host_is_data_loss_naming_the_slice_and_the_other_slice_answers(proxy):
    """Last in this module: it takes a host of the fleet away (and brings it back)."""
    proc = subprocess.Popen([sys.executable, "-c", proxy_scripts.LOSS], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(proxy))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_until(lambda: sum(ln.startswith("STEP") for ln in lines) >= 3, 180,
                   "the script did not start training")
        victim = next(ln.split()[1] for ln in lines if ln.startswith("SLICE0"))
        proxy.fleet.remove_host(victim, 0)
        assert proc.wait(timeout=240) == 0, "".join(lines[-20:]) + proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    got = json.loads(next(ln for ln in lines if ln.startswith("RESULT"))
                     .removeprefix("RESULT"))
    assert got["type"] == "JaxRuntimeError" and "DATA_LOSS" in got["error"], got
    assert victim in got["error"] and f"{victim}/0" in got["error"], got
    assert got["slice_down"] is True  # pathwaysutils.elastic's own reading of it
    assert "DATA_LOSS" in got["read_lost"]  # an array on the lost slice is gone, by name
    assert "DATA_LOSS" in got["read_host_lost"]  # its host memory too; slice 1's is kept
    assert got["z_host"] == float(np.arange(32).sum())
    assert "DATA_LOSS" in got["mixed"] and victim in got["mixed"]  # a mesh mixing it too
    # colocated Python on the lost host: by name, not a hang; slice 1's host still runs it
    assert "DATA_LOSS" in got["colocated_lost"] and victim in got["colocated_lost"], got
    assert got["colocated_other"] == [2.0] * 4
    assert len(got["other"]) == 32  # slice 1 keeps answering
    assert got["active"] == [1]
    proxy.fleet.restore_host(victim, 0)



def test_pathwaysutils_elastic_goes_on_without_a_lost_slice_and_scales_back_when_restored(
        proxy):
    """An unmodified ``pathwaysutils.elastic`` loop (``proxy_scripts.ELASTIC``) on both
    slices: a host of slice 1 killed while it trains -> it goes on on slice 0 with no
    restart; the host restored -> the same session takes the slice back (same index)
    and trains on both again; every step's loss equals local JAX following the same
    schedule of slices. Last in this module: it takes a host away and brings it back."""
    proc = subprocess.Popen([sys.executable, "-c", proxy_scripts.ELASTIC],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(proxy))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def steps_on(n: int) -> int:
        return sum(1 for ln in list(lines) if ln.startswith("STEP") and ln.split()[2] == str(n))

    def said() -> str:
        return "".join(lines[-20:]) + (proc.stderr.read()[-4000:] if proc.poll() is not None
                                       else "")
    try:
        wait_until(lambda: steps_on(2) >= 3 or proc.poll() is not None, 240,
                   "the script did not start training on both slices")
        assert proc.poll() is None, said()
        victim = next(ln.split()[1] for ln in lines if ln.startswith("SLICE1"))
        proxy.fleet.remove_host(victim, 0)
        wait_until(lambda: steps_on(1) >= 3 or proc.poll() is not None, 240,
                   "training did not go on on slice 0 alone")
        assert proc.poll() is None, said()
        proxy.fleet.restore_host(victim, 0)
        assert proc.wait(timeout=420) == 0, said()
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    got = json.loads(next(ln for ln in lines if ln.startswith("RESULT")).removeprefix("RESULT"))
    counts = got["counts"]
    assert counts[0] == 2 and 1 in counts and counts[-5:] == [2] * 5, counts
    assert got["attempts"] >= 3  # both slices, slice 0 alone, both again
    want = _script(proxy_scripts.ELASTIC, env={
        "ELASTIC_SCHEDULE": json.dumps(counts),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
