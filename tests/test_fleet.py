"""An emulated fleet of 2 v6e 2x4 slices (2 hosts x 4 chips each) on a real Ray cluster.

One fleet for the whole module. The tests run in file order; the host-removal
test comes last but one because it takes a host away (the last one, doctor's, freezes
another and names both).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray

from pathways_ray import LocalFleet, ReservationTimeout, Slice, WorkerDied
from pathways_ray.clusters.registry import list_registered_slices

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet():
    # conftest gives this driver 8 fake CPU devices (XLA_FLAGS); the chip workers
    # inherit that and must still get one device each.
    assert "device_count=8" in os.environ["XLA_FLAGS"]
    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x4", chips_per_host=4,
                    name="tfleet") as f:
        yield f


@pytest.fixture(scope="module")
def slices(fleet):
    a = Slice.reserve("v6e-2x4", chips_per_host=4, timeout_s=60)
    b = Slice.reserve("v6e-2x4", chips_per_host=4, timeout_s=60)
    yield a, b
    a.shutdown()
    b.shutdown()


def _tpu_nodes():
    return [n for n in ray.nodes() if n["Alive"] and "TPU" in n["Resources"]]


def test_hosts_have_gke_tpu_resources_and_labels(fleet):
    """Every emulated host carries exactly what Ray derives on a GKE TPU host."""
    nodes = _tpu_nodes()
    assert len(nodes) == 4
    seen = set()
    for n in nodes:
        labels, res = n["Labels"], n["Resources"]
        name, wid = labels["ray.io/tpu-slice-name"], labels["ray.io/tpu-worker-id"]
        seen.add((name, wid))
        assert labels["ray.io/tpu-pod-type"] == "v6e-8"
        assert labels["ray.io/tpu-topology"] == "2x4"
        assert labels["ray.io/accelerator-type"] == "TPU-V6E"
        assert res["TPU"] == 4
        assert res["accelerator_type:TPU-V6E"] == 1
        assert res[name] == 1
        assert ("TPU-v6e-8-head" in res) == (wid == "0")
    assert seen == {(s, w) for s in ("v6e-2x4-0", "v6e-2x4-1") for w in ("0", "1")}
    head = [n for n in ray.nodes() if n["Alive"] and "TPU" not in n["Resources"]]
    assert len(head) == 1, "the head is a CPU-only node, like a KubeRay head pod"


def test_host_processes_see_gke_env(fleet):
    """A task on a host sees TPU_NAME, TPU_WORKER_ID, TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY,
    and the env every pathways-ray node has (Ray Serve's throughput settings)."""
    from pathways_ray.clusters.host_plan import NODE_ENV

    @ray.remote(num_cpus=0, resources={"TPU-v6e-8-head": 0.001})
    def env():
        return {k: os.environ.get(k) for k in
                ("TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY",
                 *NODE_ENV)}

    got = ray.get(env.remote(), timeout=60)
    assert got["TPU_NAME"] in ("v6e-2x4-0", "v6e-2x4-1")
    assert got["TPU_WORKER_ID"] == "0"
    assert got["TPU_ACCELERATOR_TYPE"] == "v6e-8"
    assert got["TPU_TOPOLOGY"] == "2x4"
    assert {k: got[k] for k in NODE_ENV} == NODE_ENV


def test_fleet_view(fleet):
    """The fleet groups its hosts into two intact, free slices."""
    views = fleet.slices()
    assert [v.name for v in views] == ["v6e-2x4-0", "v6e-2x4-1"]
    assert all(v.intact and v.state == "free" and v.chips == 8 for v in views)


def test_doctor_examines_every_host_on_itself(fleet):
    """`pathways-ray doctor --cluster`, as a user runs it with the fleet's exports: each
    host examined by a task on it (its own env, its own subprocess opening a chip),
    checked against Ray's view of it; every chip worker's env is its rank's."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-m", "pathways_ray.cli.main", "doctor", "--cluster",
                          "--json"], env={**env, **fleet.env}, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    hosts = json.loads(out.stdout)
    assert [h["key"] for h in hosts] == [f"v6e-2x4-{s}/{w}" for s in (0, 1) for w in (0, 1)]
    for h in hosts:
        assert [c["level"] for c in h["checks"]] == ["ok"] * 5, h["checks"]
        assert h["emulated"] and h["opened"]["platform"] == "cpu"
        assert h["ray"]["node_id"] == fleet.node_ids[h["key"]]
        worker = int(h["env"]["TPU_WORKER_ID"])
        assert [r["rank"] for r in h["chip_workers"]] == [str(4 * worker + c) for c in range(4)]


def test_reserve_both_slices_with_ranked_chip_workers(fleet, slices):
    """Each slice gets one worker per chip, ranked by (TPU worker id, chip), one JAX world."""
    a, b = slices
    assert {a.name, b.name} == {"v6e-2x4-0", "v6e-2x4-1"}
    for s in (a, b):
        assert s.num_chips == 8
        assert [(w.info.worker_id, w.info.chip) for w in s.workers] == [
            (h, c) for h in range(2) for c in range(4)]
        assert [w.rank for w in s.workers] == list(range(8))
        assert len({w.info.pid for w in s.workers}) == 8
        nodes_by_host = {w.info.worker_id: w.info.node_id for w in s.workers}
        assert nodes_by_host[0] == fleet.node_ids[f"{s.name}/0"]
        assert nodes_by_host[1] == fleet.node_ids[f"{s.name}/1"]
        for rank, world in enumerate(s.world):
            assert world["process_index"] == rank
            assert world["device_count"] == 8
            assert world["platform"] == "cpu"
    assert all(v.state == "busy" for v in fleet.slices())


def test_all_reduce_per_slice(slices):
    """A real XLA all-reduce over gloo: every chip gets the sum of all chips' values."""
    a, b = slices
    got = a.all_reduce([np.full((2, 3), r + 1, np.float32) for r in range(8)])
    assert len(got) == 8
    for g in got:
        np.testing.assert_array_equal(g, np.full((2, 3), 36, np.float32))
    got = b.all_reduce([np.arange(4, dtype=np.int32) * r for r in range(8)])
    for g in got:
        np.testing.assert_array_equal(g, np.arange(4) * 28)


def test_each_chip_computes_on_one_xla_thread_and_every_cpu(slices):
    """Emulated chips share the machine's cores: each chip's XLA CPU client has a
    one-thread compute pool, and no thread is left pinned to one CPU by making it."""
    cpus = os.sched_getaffinity(0)
    for w in slices[0].workers:
        tasks = f"/proc/{w.info.pid}/task"
        names = {int(t): open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)}
        assert list(names.values()).count("tf_XLAEigen") == 1, sorted(names.values())
        for tid in names:
            try:
                assert os.sched_getaffinity(tid) == cpus, (names[tid], os.sched_getaffinity(tid))
            except ProcessLookupError:  # a thread that ended meanwhile
                pass


def test_status_registry_sees_reserved_slices(slices):
    """Reserved slices are visible to other processes with their workers' health."""
    recs = {r["name"]: r for r in list_registered_slices()}
    assert set(recs) == {s.name for s in slices}
    for r in recs.values():
        assert [w["health"] for w in r["workers"]] == ["ok"] * 8


def test_reservation_that_cannot_fit_times_out_clearly(slices):
    """With both slices held, a third reservation fails within its timeout and says why."""
    with pytest.raises(ReservationTimeout) as exc:
        Slice.reserve("v6e-2x4", chips_per_host=4, timeout_s=2)
    text = str(exc.value)
    assert "v6e 2x4" in text and "v6e-8" in text
    assert "timeout_s=2" in text and "PATHWAYS_RAY_RESERVE_TIMEOUT_S" in text
    assert "v6e-2x4-0 (v6e-8, 2x4): busy, 0/8 chips free" in text
    # A shape the cluster does not have at all fails the same way.
    with pytest.raises(ReservationTimeout, match="v5p 2x2x2"):
        Slice.reserve("v5p-2x2x2", timeout_s=2)
    # Nothing half-reserved is left behind: both slices still show as fully used.
    views = {v.name: v for v in ray_slices()}
    assert all(v.chips_free == 0 for v in views.values())


def ray_slices():
    from pathways_ray.clusters.cluster import cluster_slices

    return cluster_slices()


@ray.remote(num_cpus=0)
class _Rank:
    """One rank of a group whose peer may die: the survivors' collective fails with a
    plain error ("connection closed by peer") as soon as the dead one's socket closes."""

    def fail(self):
        raise RuntimeError("Gloo all-reduce failed: Connection closed by peer")

    def die(self, after_s):
        import time

        time.sleep(after_s)
        os._exit(1)


def test_a_peers_death_is_reported_not_the_survivors_echo_of_it(fleet):
    """Ray raises the first error it sees; when a live rank's error comes before its
    dead peer's, the death is still what the caller gets (it failed CI once as a bug)."""
    from pathways_ray import boundary
    from pathways_ray.errors import PathwaysError

    survivor, doomed = _Rank.remote(), _Rank.remote()
    refs = [survivor.fail.remote(), doomed.die.remote(1.0)]
    with pytest.raises(WorkerDied, match="the peer died"):
        boundary.get(refs, timeout=30, what="a test group",
                     died=lambda e: WorkerDied(f"the peer died: {type(e).__name__}"))
    # With no death among them, the error is reported as it is.
    with pytest.raises(PathwaysError, match="RuntimeError"):
        boundary.get([survivor.fail.remote(), survivor.fail.remote()], timeout=30,
                     what="a test group", died=lambda e: WorkerDied("no"))
    ray.kill(survivor)


def test_removing_a_host_kills_exactly_its_workers(fleet, slices):
    """Killing one emulated host kills the 4 chip workers on it and no other worker."""
    a, b = slices
    victim = b.name
    on_host = " ".join(" ".join(p.cmdline()) for p in fleet.host_processes(victim, 1))
    # Ray's agents carry no tag of ours: they are found by the host's session.
    assert "DashboardAgent" in on_host and "RuntimeEnvAgent" in on_host, on_host
    # A live host's processes have used CPU (a Python interpreter's start alone does).
    assert fleet.host_cpu_s(victim, 1) > 0.5
    node_id = fleet.remove_host(victim, 1)
    assert node_id == fleet.node_ids[f"{victim}/1"]
    assert fleet.host_processes(victim, 1) == [], (
        "the host's raylet and agents die with it")
    assert fleet.host_cpu_s(victim, 1) == 0.0  # nothing of it left to count
    health = dict((w.rank, state) for w, state in b.health(timeout_s=10))
    assert [health[r] for r in range(4)] == ["ok"] * 4
    assert [health[r] for r in range(4, 8)] == ["dead"] * 4
    assert [s for _, s in a.health(timeout_s=10)] == ["ok"] * 8
    with pytest.raises(WorkerDied, match="TPU worker 1"):
        b.all_reduce([np.ones(1)] * 8, timeout_s=30)
    # The other slice keeps working.
    np.testing.assert_array_equal(a.all_reduce([np.ones(1)] * 8)[0], [8.0])
    view = {v.name: v for v in fleet.slices()}
    assert view[victim].state == "degraded" and view[a.name].intact


def test_doctor_names_a_frozen_host_and_a_lost_one_without_waiting_on_them(fleet, slices):
    """After the removal above: the lost host is named dead, a frozen host is named late
    once --timeout is up (the others are not held up by it), and chips of reserved
    slices are not opened."""
    import time

    from pathways_ray.chips.doctor import diagnose, problems
    from pathways_ray.chips.doctor_probe import survey

    a, b = slices
    fleet.freeze_host(a.name, 1)
    try:
        t0 = time.monotonic()
        hosts = {h.key: h for h in survey(timeout_s=4)}
        took = time.monotonic() - t0
    finally:
        fleet.freeze_host(a.name, 1, frozen=False)
    assert took < 15, took
    found = {key: problems(diagnose(h)) for key, h in hosts.items()}
    assert [p.what for p in found[f"{b.name}/1"]] == [
        f"Ray marks this host's node {fleet.node_ids[f'{b.name}/1'][:8]} dead"]
    frozen = found[f"{a.name}/1"]
    assert len(frozen) == 1 and "did not answer within 4 s (--timeout)" in frozen[0].what
    for key in (f"{a.name}/0", f"{b.name}/0"):
        assert found[key] == [], found[key]
        assert hosts[key].open_note == ("not opened: chip workers of a reserved slice hold "
                                        "the chips")
