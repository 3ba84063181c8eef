"""A shared service on an emulated fleet of 2 x v6e 2x2: leases, the queue, heartbeats,
isolation, metrics, a notebook through a real Jupyter kernel, and stopping it.

The service is started by the CLI (a process that exits: the service outlives it);
clients run as processes of their own (tests/service_client.py), so that they can be
killed and frozen for real. The tests share the service and run in file order.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_ray as pr
from pathways_ray.service import control as service
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 6.0
NAME = "team"


@pytest.fixture(scope="module")
def fleet():
    saved = os.environ.get("PATHWAYS_RAY_HEARTBEAT_TIMEOUT_S")
    os.environ["PATHWAYS_RAY_HEARTBEAT_TIMEOUT_S"] = str(HEARTBEAT_S)
    try:
        with pr.LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="tsv") as f:
            yield f
    finally:
        if saved is None:
            os.environ.pop("PATHWAYS_RAY_HEARTBEAT_TIMEOUT_S", None)
        else:
            os.environ["PATHWAYS_RAY_HEARTBEAT_TIMEOUT_S"] = saved


def _cli(fleet, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pathways_ray.cli.main", "service", *args],
                          env={**os.environ, **fleet.env, "COLUMNS": "160"},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def team(fleet):
    out = _cli(fleet, "start", "--name", NAME)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "0/8 chips in use" in out.stdout and "free" in out.stdout, out.stdout
    try:
        yield NAME
    finally:
        if NAME in service.list_services():
            service.stop_service(NAME)


def _status() -> dict:
    return service.service_status(NAME)


def _wait_until(cond, timeout_s: float, what: str):
    return wait_until(cond, timeout_s, what, every_s=0.2,
                      detail=lambda: f"service status: {_status()}")


class Client:
    """tests/service_client.py as a process of its own, its stdout read line by line."""

    def __init__(self, fleet, user: str, shape: str = "v6e-2x2"):
        self.user = user
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "service_client.py"), NAME, shape],
            env={**os.environ, **fleet.env, "PATHWAYS_RAY_USER": user}, cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err.append),
                         daemon=True).start()

    @staticmethod
    def _read(stream, put):
        for line in stream:
            put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.01, left))
            except queue.Empty:
                line = None
            if line is not None:
                self.seen.append(line)
                if line.startswith(prefix):
                    return line
                if line.startswith(("ERROR", "REVOKED")) and not prefix.startswith(
                        ("ERROR", "REVOKED")):
                    pytest.fail(f"{self.user}: {line}\n" + "\n".join(self.err[-20:]))
            if time.monotonic() >= deadline:
                pytest.fail(f"{self.user} printed no {prefix!r} within {timeout_s:g} s; "
                            f"last lines {self.seen[-3:]}; stderr:\n" + "\n".join(self.err[-20:]))

    def steps(self) -> int:
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return sum(1 for line in self.seen if line.startswith("STEP"))

    def stop(self) -> None:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _lease_of(line: str) -> tuple[str, str, int, int]:
    m = re.match(r"LEASED (\S+) (\S+) buffers=(\d+) programs=(\d+)", line)
    return m[1], m[2], int(m[3]), int(m[4])


# ---- leases, the queue, SIGKILL ------------------------------------------------------------
def test_two_train_at_once_a_third_waits_its_turn_and_a_killed_one_is_reclaimed(fleet, team):
    alice, bob = Client(fleet, "alice"), Client(fleet, "bob")
    carol = None
    try:
        a_lease, a_slice, *_ = _lease_of(alice.expect("LEASED"))
        b_lease, b_slice, *_ = _lease_of(bob.expect("LEASED"))
        assert a_slice != b_slice and a_lease != b_lease
        # Both train at once: each makes progress while the other holds its lease.
        a0, b0 = alice.steps(), bob.steps()
        _wait_until(lambda: alice.steps() >= a0 + 3 and bob.steps() >= b0 + 3, 60,
                    "both clients did not step")

        carol = Client(fleet, "carol")
        _wait_until(lambda: any("position 1 of 1" in e for e in carol.err), 120,
                    "carol did not say her queue position")
        st = _status()
        assert st["numbers"]["leases"] == 2 and st["numbers"]["queue_length"] == 1
        assert st["numbers"]["active_users"] == 2 and st["numbers"]["chips_in_use"] == 8
        shown = _cli(fleet, "status", "--name", NAME).stdout
        for part in ("2 users, 2 leases, 8/8 chips in use (100%), 1 waiting", "alice@",
                     "bob@", "carol@", "queue", a_lease, b_lease):
            assert part in shown, shown

        alice.stop()  # alice disconnects: carol gets her slice, empty
        alice.expect("CLOSED", 60)
        assert alice.proc.wait(30) == 0
        c_lease, c_slice, buffers, programs = _lease_of(carol.expect("LEASED", 60))
        assert c_slice == a_slice and (buffers, programs) == (0, 0)
        carol.expect("STEP", 60)

        bob.kill()  # SIGKILL: the lease comes back within the heartbeat timeout
        t0 = time.monotonic()
        _wait_until(lambda: b_lease not in {ls["id"] for ls in _status()["leases"]},
                    HEARTBEAT_S + 2, "bob's lease was not reclaimed")
        took = time.monotonic() - t0
        _wait_until(lambda: {s["name"]: s["state"] for s in _status()["slices"]}[b_slice]
                    == "free", 15, "bob's slice did not come back free")
        assert took < HEARTBEAT_S + 2
        carol.stop()
        carol.expect("CLOSED", 60)
        st = _status()["numbers"]
        assert (st["leases"], st["queue_length"], st["slices"]["free"]) == (0, 0, 2)
        assert st["granted_total"] >= 3 and st["reclaimed_total"] >= 1
    finally:
        for c in (alice, bob, carol):
            if c is not None:
                c.kill()


def test_a_frozen_client_loses_its_lease_and_is_told_so_when_it_wakes(fleet, team):
    dave = Client(fleet, "dave")
    erin = None
    try:
        d_lease, d_slice, *_ = _lease_of(dave.expect("LEASED"))
        dave.expect("STEP")
        os.kill(dave.proc.pid, signal.SIGSTOP)  # a frozen laptop: no heartbeats
        t0 = time.monotonic()
        _wait_until(lambda: d_lease not in {ls["id"] for ls in _status()["leases"]},
                    HEARTBEAT_S + 5, "dave's lease was not taken back")
        # By the heartbeat (its last beat came up to a fifth of the timeout before the
        # stop), not earlier: its controller is alive.
        assert time.monotonic() - t0 >= HEARTBEAT_S * 0.7
        # Both slices are free again: the next client may get dave's.
        erin = pr.connect(service=NAME, slices={"v6e-2x2": 2})
        mesh = erin.mesh((4,), ("d",))
        mine = {s.name: erin.device_put(np.full(8, i, np.float32), NamedSharding(mesh, P("d")),
                                        slice=s.name) for i, s in enumerate(erin.slices)}
        os.kill(dave.proc.pid, signal.SIGCONT)
        line = dave.expect("REVOKED", 60)
        assert "taken back" in line or "ended" in line, line
        assert dave.proc.wait(30) == 3
        for i, s in enumerate(erin.slices):  # dave reached none of it
            np.testing.assert_array_equal(mine[s.name].fetch(), np.full(8, i, np.float32))
    finally:
        if dave.proc.poll() is None:
            os.kill(dave.proc.pid, signal.SIGCONT)
        dave.kill()
        if erin is not None:
            erin.close()


# ---- isolation ----------------------------------------------------------------------------
def test_a_handle_of_another_lease_is_refused_and_chips_refuse_a_forged_token(fleet, team):
    from pathways_ray import boundary
    from pathways_ray.clusters import registry
    from pathways_ray.config import NAMESPACE

    a = pr.connect(service=NAME, slices={"tpuv6e:2x2": 1})  # pathwaysutils' spelling
    b = pr.connect(service=NAME, slices={"v6e-2x2": 1})
    try:
        assert a.slices[0].name != b.slices[0].name
        sh = NamedSharding(a.mesh((4,), ("d",)), P("d"))
        xa = a.device_put(np.arange(8, dtype=np.float32), sh)
        xb = b.device_put(np.ones(8, np.float32), sh)
        for misuse in (lambda: b.jit(lambda v: v + 1)(xa),
                       lambda: b.reshard(xa, sh, slice=b.slices[0].name),
                       lambda: b.block_until_ready([xa])):
            with pytest.raises(ValueError, match=rf"belongs to lease {a.lease} .* not to this "
                                                 rf"client \(lease {b.lease}"):
                misuse()
        np.testing.assert_array_equal(b.jit(lambda v: v + 1)(xb).fetch(), np.full(8, 2.0))
        # A chip serves only calls presenting its lease's token: not a forged one, not none.
        rec = next(r for r in registry.list_registered_slices() if r["name"] == a.slices[0].name)
        import ray

        chip = ray.get_actor(rec["workers"][0]["actor"], namespace=NAMESPACE)
        for token in ("forged", None):
            with pytest.raises(pr.LeaseRevoked, match="is not lent to the lease this call "
                                                      "presents"):
                boundary.get(chip.shard.remote(xa._id, 0, lease=token), timeout=30, what="x")
        np.testing.assert_array_equal(xa.fetch(), np.arange(8, dtype=np.float32))
        # Bad requests are named before anything queues.
        with pytest.raises(ValueError, match="'v6e-3x3' is not a slice shape"):
            pr.connect(service=NAME, slices={"v6e-3x3": 1})
        with pytest.raises(ValueError, match=r"3 x v6e-2x2 asked, but this service's pool has "
                                             r"2 x v6e-2x2"):
            pr.connect(service=NAME, slices={"v6e-2x2": 3})
        with pytest.raises(ValueError, match="service='nope': no such service"):
            pr.connect(service="nope", slices={"v6e-2x2": 1})
        with pytest.raises(pr.ReservationTimeout, match=r"within 1 s \(lease_timeout_s=\); "
                                                        r"position 1"):
            pr.connect(service=NAME, slices={"v6e-2x2": 1}, lease_timeout_s=1)
        assert _status()["numbers"]["queue_length"] == 0  # who gave up left the queue
    finally:
        a.close()
        b.close()


def test_one_lease_stalls_not_the_other_and_a_broken_slice_is_replaced(fleet, team):
    os.environ["PATHWAYS_RAY_STEP_TIMEOUT_S"] = "4"  # the frozen chip's deadline
    try:
        a = pr.connect(service=NAME, slices={"v6e-2x2": 1})
        b = pr.connect(service=NAME, slices={"v6e-2x2": 1})
    finally:
        os.environ.pop("PATHWAYS_RAY_STEP_TIMEOUT_S")
    try:
        sa = a.slices[0].name
        replaced = _status()["numbers"]["replaced_total"]
        sh = NamedSharding(a.mesh((4,), ("d",)), P("d"))
        xa = a.device_put(np.arange(8, dtype=np.float32), sh)
        xb = b.device_put(np.arange(8, dtype=np.float32), sh)
        pids = a._controller.__ray_call__.remote(
            lambda c: [w.info.pid for w in c.slices[sa].workers])
        import ray

        victim = ray.get(pids, timeout=30)[1]
        os.kill(victim, signal.SIGSTOP)  # a chip of a's slice stops answering
        got: dict = {}

        def long_fetch():
            try:
                got["value"] = a.jit(lambda v: v * 3)(xa).fetch()
            except pr.PathwaysError as e:
                got["error"] = e

        t = threading.Thread(target=long_fetch)
        t.start()
        step = b.jit(lambda v: v + 1)
        for _ in range(20):  # b is not held up by a's stalled fetch
            xb = step(xb)
        np.testing.assert_array_equal(xb.fetch(), np.arange(8) + 20)
        assert t.is_alive() or "error" in got  # a is still stalled, or already failed
        t.join(60)
        assert isinstance(got.get("error"), pr.SliceLost), got
        assert got["error"].slice == sa
        a.close()
        # The service finds the slice broken, releases it and reserves a new one.
        _wait_until(lambda: (n := _status()["numbers"])["replaced_total"] == replaced + 1
                    and n["slices"]["free"] == 1, 120, "the broken slice was not replaced")
        np.testing.assert_array_equal(b.jit(lambda v: v * 2)(xb).fetch(), (np.arange(8) + 20) * 2)
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except (ProcessLookupError, NameError):
            pass
        a.close()
        b.close()
    assert _status()["numbers"]["slices"] == {"free": 2, "leased": 0, "returning": 0,
                                              "broken": 0}


# ---- numbers --------------------------------------------------------------------------------
def test_the_numbers_are_ray_metrics_in_prometheus_format(fleet, team):
    import ray

    c = pr.connect(service=NAME, slices={"v6e-2x2": 1})
    try:
        ports = {(n["NodeManagerAddress"], n["MetricsExportPort"]) for n in ray.nodes()
                 if n["Alive"] and n.get("MetricsExportPort")}
        assert ports

        def scrape() -> str:
            for host, port in ports:
                try:
                    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
                        text = r.read().decode()
                except OSError:
                    continue
                if re.search(r'ray_pathways_ray_service_leases\{[^}]*service="team"[^}]*\} 1',
                             text):
                    return text
            return ""

        text = _wait_until(scrape, 60, "the service's metrics did not reach Prometheus")
        for name in ("active_users", "chips_in_use", "chips_total", "capacity_in_use",
                     "queue_length", "lease_wait_seconds_bucket"):
            assert f"ray_pathways_ray_service_{name}" in text, name
    finally:
        c.close()


# ---- a notebook --------------------------------------------------------------------------
def test_the_notebook_runs_twice_in_a_real_kernel_and_finds_no_leftovers(fleet, team):
    # nbclient runs in a process of its own: its ZeroMQ context and event loop stay out
    # of this one (which must exit cleanly after every other test module too).
    run = ("import json, sys, nbformat\n"
           "from nbclient import NotebookClient\n"
           "nb = nbformat.read(sys.argv[1], as_version=4)\n"
           "NotebookClient(nb, timeout=300, kernel_name='python3',\n"
           "               resources={'metadata': {'path': sys.argv[2]}}).execute()\n"
           "print(json.dumps([o.get('text', '') for c in nb.cells\n"
           "                  for o in c.get('outputs', [])]))\n")
    keep = pr.connect(service=NAME, slices={"v6e-2x2": 1})  # both runs get the other slice
    try:
        slices = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", run, str(ROOT / "examples" / "shared_service.ipynb"),
                 str(ROOT)], env={**os.environ, **fleet.env, "PATHWAYS_RAY_SERVICE": NAME},
                capture_output=True, text=True, timeout=400)
            assert out.returncode == 0, out.stderr[-3000:]
            text = "\n".join(json.loads(out.stdout.splitlines()[-1]))
            assert "left on the chips by earlier leases: {'buffers': 0, 'programs': 0}" in text
            slices.append(re.search(r"slice (\S+) \(v6e-2x2, 4 chips\)", text)[1])
        # The first run's kernel exited with its lease open; the second got that same
        # slice back, empty.
        assert slices[0] == slices[1] != keep.slices[0].name
    finally:
        keep.close()


# ---- stopping --------------------------------------------------------------------------
def test_stopping_the_service_releases_every_slice_and_process(fleet, team):
    import psutil
    import ray

    from pathways_ray.clusters.cluster import cluster_slices

    held = pr.connect(service=NAME, slices={"v6e-2x2": 1})  # a lease open as it stops
    sh = NamedSharding(held.mesh((4,), ("d",)), P("d"))
    x = held.device_put(np.ones(4, np.float32), sh)
    # The service's process, its chip workers' and the lease's controller's.
    pids = ray.get(service.get_service(NAME).__ray_call__.remote(
        lambda s: [w.info.pid for sl in s._slices.values() for w in sl.workers]
        + [__import__("os").getpid()]), timeout=30)
    pids.append(ray.get(held._controller.__ray_call__.remote(
        lambda _: __import__("os").getpid()), timeout=30))
    assert len(pids) == 10
    out = _cli(fleet, "stop", "--name", NAME)
    assert out.returncode == 0, out.stderr
    assert "released 2 slices, ended 1 leases" in out.stdout, out.stdout
    assert NAME not in service.list_services()
    with pytest.raises(pr.LeaseRevoked, match="service 'team'"):
        held.jit(lambda v: v * 2)(x).fetch()
    held.close()

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    _wait_until(lambda: all(gone(p) for p in pids), 30, "processes outlived the service")
    _wait_until(lambda: all(v.idle for v in cluster_slices()), 30,
                "slices stayed reserved after the service stopped")
    assert not [pg for pg in ray.util.placement_group_table().values()
                if pg["state"] != "REMOVED"]
