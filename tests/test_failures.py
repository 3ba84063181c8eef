"""A host dies under a running client: what the user sees is ours, prompt, and exact.

One fleet of 2 x v6e 2x2 (two emulated hosts). Slice 1's host is killed for real
(``LocalFleet.remove_host``: SIGKILL to its raylet and every process on it)
while both slices run the same program.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest
import ray
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray import ControllerDied, LocalFleet, RemoteError, SliceLost, connect, reshard
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="tfail") as f:
        f.removed = []  # slices whose host a test removed, restored by the next
        yield f


def _remove(fleet, slice_name: str) -> None:
    fleet.remove_host(slice_name, 0)
    fleet.removed.append(slice_name)


def _restore(fleet) -> None:
    while fleet.removed:
        fleet.restore_host(fleet.removed.pop(), 0)


def _step(v):
    return jnp.tanh(v) * 0.5 + v.mean()


def _expected(x: np.ndarray, n: int) -> np.ndarray:
    for _ in range(n):
        x = np.tanh(x) * 0.5 + x.mean()
    return x


def _one_step_on_both(client):
    """The same step on both slices, checked equal: ``(s0, s1, x, step, a, b)``."""
    s0, s1 = (s.name for s in client.slices)
    sh = NamedSharding(client.mesh((4,), ("chips",)), P("chips"))
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    step = client.jit(_step)
    a, b = client.device_put(x, sh, slice=s0), client.device_put(x, sh, slice=s1)
    a, b = step(a), step(b)
    np.testing.assert_array_equal(a.fetch(), b.fetch())
    return s0, s1, x, step, a, b


def test_losing_a_host_raises_slice_lost_and_the_other_slice_runs_on(fleet):
    """Steps run on both slices; slice 1's host is removed. The next call touching slice
    1 raises SliceLost naming the slice and its host within seconds (not a Ray error,
    not a 600 s timeout); a reshard from it raises SliceLost and leaves nothing failed
    on slice 0; slice 0 keeps running the same program with exact results; later calls
    on slice 1 fail at once; close() returns promptly."""
    client = connect()
    s0, s1 = (s.name for s in client.slices)
    mesh = client.mesh((4,), ("chips",))
    sh = NamedSharding(mesh, P("chips"))
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    step = client.jit(_step)
    a, b = client.device_put(x, sh, slice=s0), client.device_put(x, sh, slice=s1)
    for _ in range(5):
        a, b = step(a), step(b)
    np.testing.assert_array_equal(b.fetch(), a.fetch())  # one program, bit for bit
    np.testing.assert_allclose(a.fetch(), _expected(x, 5), rtol=1e-5, atol=1e-6)
    b0 = b.fetch()

    _remove(fleet, s1)
    t0 = time.monotonic()
    with pytest.raises(SliceLost) as lost:
        step(b).fetch()
    took = time.monotonic() - t0
    assert took < 30, f"SliceLost took {took:.1f}s"
    err = lost.value
    assert not isinstance(err, ray.exceptions.RayError)
    assert err.slice == s1 and err.hosts == (f"{s1}/0",), err
    assert s1 in str(err) and "other slices keep running" in str(err)
    assert "host died" in err.reason and "\n" not in str(err), err

    # Once known, every call on slice 1 fails at once, before anything is sent.
    t0 = time.monotonic()
    for call in (lambda: step(b), lambda: client.device_put(x, sh, slice=s1),
                 lambda: b.fetch(), lambda: reshard(a, sh, slice=s1)):
        with pytest.raises(SliceLost, match=s1):
            call()
    assert time.monotonic() - t0 < 5

    # Slice 0 runs on: the same program, the results slice 1 would have had (it held b0
    # after 5 steps, as slice 0 did), nothing of it marked failed.
    for _ in range(5):
        a = step(a)
    c = client.device_put(b0, sh, slice=s0)
    for _ in range(5):
        c = step(c)
    np.testing.assert_array_equal(a.fetch(), c.fetch())
    np.testing.assert_allclose(a.fetch(), _expected(x, 10), rtol=1e-5, atol=1e-6)
    assert client.stats().keys() == {s0}

    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 30


def _on_slice_1(client, x: np.ndarray):
    """``x`` put on slice 1 over 4 chips and read back: ``(s0, s1, sharding, array)``."""
    s0, s1 = (s.name for s in client.slices)
    sh = NamedSharding(client.mesh((4,), ("chips",)), P("chips"))
    on1 = client.device_put(x, sh, slice=s1)
    np.testing.assert_array_equal(on1.fetch(), x)
    return s0, s1, sh, on1


def test_a_reshard_from_a_lost_slice_raises_and_creates_nothing(fleet):
    """The host comes back (a new slice under the old name); a client holding both
    slices loses slice 1 again, and a cross-slice reshard of an array that lived there
    raises SliceLost at the reshard, not a RemoteError at some later fetch."""
    _restore(fleet)
    client = connect()
    try:
        x = np.arange(16, dtype=np.float32).reshape(4, 4)
        s0, s1, sh, on1 = _on_slice_1(client, x)
        _remove(fleet, s1)
        with pytest.raises(SliceLost, match=s1):
            reshard(on1, sh, slice=s0)
        # The user's own error stays a RemoteError and costs no slice.
        bad = client.jit(lambda v: v @ jnp.ones((3, 3), v.dtype))
        with pytest.raises((RemoteError, TypeError, ValueError)):
            bad(client.device_put(x, sh, slice=s0)).fetch()
        ok = client.jit(lambda v: v * 2)(client.device_put(x, sh, slice=s0))
        np.testing.assert_array_equal(ok.fetch(), x * 2)
    finally:
        client.close()
        _restore(fleet)


def _chip_processes(fleet, slice_name: str) -> list:
    return [p for p in fleet.host_processes(slice_name, 0)
            if "ChipWorker" in " ".join(p.cmdline())]


def test_a_copy_whose_source_dies_before_it_is_pulled_fails_with_slice_lost(fleet,
                                                                           monkeypatch):
    """Chip-to-chip pulls (``pull.py``): slice 1 offers its shards, then its host dies
    before slice 0's chips (stopped meanwhile) pull them. The copy fails with
    SliceLost naming slice 1, at once and not at the pull's deadline; slice 0 stays
    healthy and usable."""
    monkeypatch.setenv("PATHWAYS_RAY_STEP_TIMEOUT_S", "120")  # slice 0 is stopped a while
    monkeypatch.setenv("PATHWAYS_RAY_TRANSFER", "pull")
    _restore(fleet)
    client = connect()
    try:
        x = np.arange(64, dtype=np.float32).reshape(16, 4)
        s0, s1, sh, on1 = _on_slice_1(client, x)
        stopped = _chip_processes(fleet, s0)
        assert len(stopped) == 4
        for p in stopped:
            p.suspend()
        try:
            copy = reshard(on1, NamedSharding(client.mesh((2, 2), ("a", "b")), P("a", "b")),
                           slice=s0)  # offered on slice 1; the pulls wait on slice 0
            _remove(fleet, s1)
        finally:
            for p in stopped:
                p.resume()
        t0 = time.monotonic()
        with pytest.raises(SliceLost, match=s1):
            copy.fetch(timeout_s=60)
        assert time.monotonic() - t0 < 30
        ok = client.jit(lambda v: v * 2)(client.device_put(x, sh, slice=s0))
        np.testing.assert_array_equal(ok.fetch(), x * 2)
        assert client.stats().keys() == {s0}
    finally:
        client.close()
        _restore(fleet)


def test_a_frozen_host_is_caught_by_the_step_deadline(fleet, monkeypatch):
    """SIGSTOP on slice 1's host (its sockets stay open; gloo would wait ~100 s for
    JAX's heartbeat): the controller's step deadline (3 s here) condemns the slice and
    the next call raises SliceLost naming the host as frozen; slice 0 runs on."""
    monkeypatch.setenv("PATHWAYS_RAY_STEP_TIMEOUT_S", "3")  # the controller inherits it
    _restore(fleet)
    client = connect()
    try:
        s0, s1, x, step, a, b = _one_step_on_both(client)
        fleet.freeze_host(s1, 0)
        fleet.removed.append(s1)
        t0 = time.monotonic()
        with pytest.raises(SliceLost) as lost:
            step(b).fetch()
        took = time.monotonic() - t0
        assert 3 <= took < 20, f"took {took:.1f}s"
        assert "frozen" in lost.value.reason and lost.value.hosts == (f"{s1}/0",)
        a = step(a)
        np.testing.assert_allclose(a.fetch(), _expected(x, 2), rtol=1e-5, atol=1e-6)
        assert ray.get(client._controller.health.remote())[s0] == "ok"
    finally:
        t0 = time.monotonic()
        client.close()
        assert time.monotonic() - t0 < 30
        fleet.freeze_host(s1, 0, frozen=False)
        try:
            fleet.remove_host(s1, 0)
        except Exception:  # noqa: BLE001 - its raylet may have exited by itself on waking
            pass


def test_a_dead_controller_raises_controller_died(fleet):
    """Killing the controller actor: the next call raises ControllerDied saying how to
    go on, and the slices it held are free by then (its placement groups outlive it);
    close() still returns."""
    _restore(fleet)
    client = connect()
    sh = NamedSharding(client.mesh((4,), ("chips",)), P("chips"))
    x = client.device_put(np.ones((4, 4), np.float32), sh)
    x.block_until_ready()
    ray.kill(client._controller)
    # ray.kill returns before the actor is gone (the kill goes through the GCS, a call
    # straight to the actor): calls sent meanwhile are still answered.
    def gone():
        try:
            ray.get(client._controller.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_until(gone, 30, "the killed controller still answers", every_s=0.1)
    with pytest.raises(ControllerDied, match=r"pathways_ray.connect\(\)"):
        x.fetch()
    _all_free_within(30)  # the dead controller's placement groups, freed as the error says
    client.close()
    _all_free_within(30)
    with connect() as again:  # so connect() can go on, as the error says
        assert len(again.slices) == 2


def _all_free_within(seconds: float) -> None:
    from pathways_ray.clusters.cluster import cluster_slices

    deadline = time.monotonic() + seconds
    while not all(v.idle for v in cluster_slices()):
        assert time.monotonic() < deadline, [(v.name, v.state) for v in cluster_slices()]
        time.sleep(0.5)


def test_asking_for_more_slices_than_free_fails_clearly_and_holds_none(fleet):
    """connect() reserves its slices side by side; when one of them cannot be had, the
    error names the shape and the timeout setting, and the slices that were reserved
    are released: nothing stays held."""
    from pathways_ray import ReservationTimeout

    _restore(fleet)
    t0 = time.monotonic()
    with pytest.raises(ReservationTimeout, match=r"v6e 2x2.*timeout_s=3"):
        connect(slices=["v6e-2x2"] * 3, reserve_timeout_s=3)
    assert time.monotonic() - t0 < 60
    _all_free_within(30)
    with connect() as client:  # and both can be reserved again
        assert len(client.slices) == 2


def test_a_chip_behind_a_relay_frozen_or_killed_loses_its_slice_naming_the_chip(fleet,
                                                                                monkeypatch):
    """The controller sends to each slice's first chip, which relays to the others
    (fanout.py). Freezing one relayed chip (SIGSTOP on its process only) silences the
    whole stream: the slice is lost at the step deadline, naming that chip; killing
    one loses its slice at once, naming it, through the relay's report."""
    import os
    import signal

    from pathways_ray.testing import DebugController

    monkeypatch.setenv("PATHWAYS_RAY_STEP_TIMEOUT_S", "3")
    _restore(fleet)
    client = connect(controller_cls=DebugController)
    stopped = None
    try:
        s0, s1, x, step, a, b = _one_step_on_both(client)
        pids0 = ray.get(client._controller.worker_pids.remote(s0))
        pids1 = ray.get(client._controller.worker_pids.remote(s1))

        stopped = pids1[2]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(SliceLost) as lost:
            step(b).fetch()
        took = time.monotonic() - t0
        assert 3 <= took < 20, f"took {took:.1f}s"
        assert "frozen" in lost.value.reason and "chip worker rank 2" in lost.value.reason
        assert lost.value.hosts == (f"{s1}/0",)
        np.testing.assert_allclose(step(a).fetch(), _expected(x, 2), rtol=1e-5, atol=1e-6)

        os.kill(pids0[3], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(SliceLost) as lost:
            for _ in range(100):  # the first may already be running; the loss shows soon
                a = step(a)
            a.fetch()
        assert time.monotonic() - t0 < 10
        assert "chip worker rank 3" in str(lost.value), lost.value
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        client.close()


def test_a_simulated_pod_slice_relays_every_batch_and_a_lost_relay_is_named(fleet):
    """Dispatch at pod scale runs on simulated chips (simulate.py): 64 chips on 16 hosts,
    3 relay levels, in 4 processes. Every chip runs every batch in order; killing the
    process of the last 16 chips loses the slice with a SliceLost naming a chip, not a
    hang or a Ray error."""
    import os
    import signal

    from pathways_ray.emulation.simulate import SimFleet

    with SimFleet(["v5p-4x4x4"], processes=4) as sim:
        client = sim.connect(max_batch=1)
        try:
            sh = NamedSharding(client.mesh((64,), ("chips",)), P("chips"))
            z = client.device_put(np.ones((64, 2), np.float32), sh)
            step = client.jit(lambda v: v * 0.5 + 1.0)
            for _ in range(30):
                z = step(z)
            client.block_until_ready([z])
            stats = sim.stats()
            assert len(stats) == 64 and all(s["missing_reads"] == 0 for s in stats)
            seen = {(s["batches"], s["commands"], s["buffers"]) for s in stats}
            assert len(seen) == 1, f"the chips ran different streams: {seen}"
            batches, commands, buffers = seen.pop()
            assert batches >= 31 and commands >= 32 and buffers == 1  # put, load, 30 runs

            os.kill(sim.pids()[-1], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(SliceLost) as lost:
                for _ in range(100):
                    z = step(z)
                client.block_until_ready([z])
            assert time.monotonic() - t0 < 20
            assert "chip worker rank" in str(lost.value)
        finally:
            client.close()


def test_pathways_ray_profile_records_a_whole_job(fleet, tmp_path):
    """`pathways-ray profile -- python job.py`: the job's client records from connect() to
    close(), and the command prints where the trace went; the trace has every chip of the
    job's slice, the controller and the client."""
    import glob
    import os
    import subprocess
    import sys

    from jax.profiler import ProfileData

    _restore(fleet)
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "import pathways_ray as pr\n"
        "pr.Fleet.attach()\n"
        "client = pr.connect(slices=['v6e-2x2'])\n"
        "sh = NamedSharding(client.mesh((4,), ('chips',)), P('chips'))\n"
        "x = client.device_put(np.ones((8, 4), np.float32), sh)\n"
        "step = client.jit(lambda v: v * 0.5 + 1.0)\n"
        "for _ in range(3):\n"
        "    x = step(x)\n"
        "print('RESULT', float(x.fetch()[0, 0]))\n"
        "client.close()\n")
    out = subprocess.run(
        [sys.executable, "-m", "pathways_ray.cli.main", "profile", "--logdir", str(tmp_path / "p"),
         "--", sys.executable, str(script)],
        env={**os.environ, **fleet.env, "COLUMNS": "300"}, capture_output=True, text=True,
        timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT 1.875" in out.stdout
    (xplane,) = glob.glob(str(tmp_path / "p" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert xplane in out.stdout and "ui.perfetto.dev" in out.stdout
    planes = {p.name.removeprefix("/device:CUSTOM:"): p
              for p in ProfileData.from_file(xplane).planes}
    chips = [n for n in planes if " chip " in n]
    assert len(chips) == 4 and {"client", "controller"} <= set(planes)
    for name in chips:
        runs = [e for line in planes[name].lines for e in line.events
                if e.name.startswith("run ")]
        assert len(runs) == 3, (name, len(runs))
