"""`pathways-ray doctor`'s rules on made-up hosts (pure, milliseconds), and its probes on
this machine: the open check in a real subprocess, a real process holding a "chip".
The emulated fleet's run is in test_fleet.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pathways_ray.chips import doctor_probe
from pathways_ray.chips.doctor import Check, HostFacts, chip_worker_envs, diagnose, problems

VERSIONS = {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1", "ray": "2.60.0",
            "pathways-ray": "0.1.0", "python": "3.11.7"}
WANTED = {"libtpu": [("==0.0.42.*", "jax 0.10.2")], "jaxlib": [("==0.10.2", "jax 0.10.2")],
          "jax": [("==0.10.2", "pathways-ray 0.1.0")]}
ENV = {"TPU_NAME": "train-a", "TPU_WORKER_ID": "1", "TPU_ACCELERATOR_TYPE": "v6e-8",
       "TPU_TOPOLOGY": "2x4", "TPU_WORKER_HOSTNAMES": "train-a-w0,train-a-w1"}
LABELS = {"ray.io/tpu-slice-name": "train-a", "ray.io/tpu-worker-id": "1",
          "ray.io/tpu-topology": "2x4", "ray.io/tpu-pod-type": "v6e-8",
          "ray.io/accelerator-type": "TPU-V6E"}


def tpu_host(**change) -> HostFacts:
    """Worker 1 of a healthy v6e 2x4 slice on GKE: 4 chips, Ray up, chip 0 opened."""
    facts = HostFacts(
        host="gke-tpu-1", versions=dict(VERSIONS), wanted=dict(WANTED),
        chip_paths=[f"/dev/vfio/{i}" for i in range(4)], env=dict(ENV),
        ray={"node_id": "ab" * 28, "alive": True, "address": "10.0.0.2:6379",
             "resources": {"TPU": 4.0, "CPU": 180.0, "train-a": 1.0,
                           "accelerator_type:TPU-V6E": 1.0},
             "labels": dict(LABELS), "available_tpu": 4.0},
        opened={"ok": True, "platform": "tpu", "device_kind": "TPU v6 lite", "devices": 1,
                "seconds": 6.2})
    for k, v in change.items():
        setattr(facts, k, v)
    return facts


def only_problem(facts: HostFacts) -> Check:
    found = problems(diagnose(facts))
    assert len(found) == 1, found
    return found[0]


def test_a_healthy_tpu_host_has_no_problem_and_says_what_it_saw():
    checks = diagnose(tpu_host())
    assert problems(checks) == []
    said = {c.area: c.what for c in checks}
    assert said["versions"].startswith("jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.42.1")
    assert said["chips"] == "4 TPU chips, ids 0-3: /dev/vfio/0, /dev/vfio/1, /dev/vfio/2, " \
                            "/dev/vfio/3"
    one = diagnose(tpu_host(chip_paths=["/dev/vfio/2"], env={}))
    assert one[1].what == "1 TPU chip, id 0: /dev/vfio/2"
    assert said["host env"] == ("slice train-a, TPU worker 1 of 2, v6e 2x4 (v6e-8: 8 chips, "
                                "2 hosts x 4), 4 chips per host")
    assert said["ray"].endswith("TPU 4, labels match the env")
    assert said["open"] == "opened chip 0 in 6.2 s: TPU v6 lite (tpu), a matmul checked"


def test_each_chip_worker_env_is_its_rank_in_the_slices_process_grid():
    rows = chip_worker_envs(tpu_host())
    assert [(r["chip"], r["rank"], r["TPU_VISIBLE_CHIPS"], r["CLOUD_TPU_TASK_ID"])
            for r in rows] == [(str(c), str(4 + c), str(c), str(4 + c)) for c in range(4)]
    assert {r["TPU_PROCESS_BOUNDS"] for r in rows} == {"2,4,1"}
    assert {r["TPU_CHIPS_PER_PROCESS_BOUNDS"] for r in rows} == {"1,1,1"}
    addresses = rows[0]["TPU_PROCESS_ADDRESSES"].split(",")
    assert addresses == ["train-a-w0:PORT"] * 4 + ["train-a-w1:PORT"] * 4
    emulated = chip_worker_envs(tpu_host(chip_paths=[], emulated=True))
    assert [r["JAX_PLATFORMS"] for r in emulated] == ["cpu"] * 4
    assert "--xla_force_host_platform_device_count=1" in emulated[0]["XLA_FLAGS"]


@pytest.mark.parametrize("change, what, fix", [
    ({"versions": {**VERSIONS, "libtpu": None}}, "libtpu is not installed: JAX 0.10.2",
     "pip install -U 'jax[tpu]==0.10.2'"),
    ({"versions": {**VERSIONS, "libtpu": "0.0.40"}},
     "libtpu 0.0.40 is installed; jax 0.10.2 needs libtpu==0.0.42.*",
     "pip install -U 'jax[tpu]==0.10.2'"),
    ({"versions": {**VERSIONS, "jax": "0.9.0"}},
     "jax 0.9.0 is installed; pathways-ray 0.1.0 needs jax==0.10.2",
     "pip install 'jax==0.9.0' 'jaxlib==0.9.0'"),
    ({"env": {k: v for k, v in ENV.items() if k != "TPU_WORKER_ID"}},
     "TPU_WORKER_ID not set: chip workers rank themselves by TPU_WORKER_ID",
     "export them before `ray start`"),
    ({"env": {**ENV, "TPU_WORKER_ID": "2"}},
     "TPU_WORKER_ID=2 is not a TPU worker of v6e 2x4", "this host's index in the slice"),
    ({"env": {**ENV, "TPU_WORKER_HOSTNAMES": "a,b,c"}},
     "TPU_WORKER_HOSTNAMES names 3 hosts; v6e 2x4 (v6e-8: 8 chips, 2 hosts x 4) has 2",
     "in worker order"),
    ({"chip_paths": ["/dev/accel0", "/dev/accel1", "/dev/accel2"]},
     "this host has 3 chips, but TPU_ACCELERATOR_TYPE=v6e-8 TPU_TOPOLOGY=2x4 says: "
     "chips_per_host=3 is not possible for v6e 2x4; use one of [8, 4]",
     "TPU_TOPOLOGY (the slice's shape"),
    ({"env": {**ENV, "JAX_PLATFORMS": "cpu"}},
     "JAX_PLATFORMS=cpu on a TPU host: chip workers would not open the chips",
     "unset JAX_PLATFORMS"),
    ({"chip_paths": [], "opened": None},
     "TPU_ACCELERATOR_TYPE=v6e-8 is set but this host shows no TPU chip",
     "google.com/tpu"),
])
def test_each_problem_is_named_with_its_fix(change, what, fix):
    found = problems(diagnose(tpu_host(**change)))
    assert found, change
    assert what in found[0].what and fix in found[0].fix, found


def test_a_container_given_one_chip_of_a_4_chip_host_is_told_both_problems():
    """What `doctor` found on the device machine: GKE-style env for a v5litepod-4 host, no
    TPU_NAME, and one of the host's chips visible in the container."""
    env = {"TPU_WORKER_ID": "0", "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_TOPOLOGY": "2x2",
           "TPU_WORKER_HOSTNAMES": "localhost"}
    found = problems(diagnose(tpu_host(chip_paths=["/dev/vfio/2"], env=env, ray=None)))
    assert [p.what for p in found] == [
        "TPU_NAME not set: chip workers rank themselves by TPU_WORKER_ID and name their "
        "slice by TPU_NAME",
        "this host has 1 chip, but TPU_ACCELERATOR_TYPE=v5litepod-4 TPU_TOPOLOGY=2x2 says: "
        "chips_per_host=1 is not possible for v5e 2x2; use one of [4]"]
    assert "google.com/tpu" in found[1].fix


def test_a_worker_id_outside_the_slice_has_no_chip_worker_envs_to_show():
    """The command prints the env table after the findings: a bad TPU_WORKER_ID is named
    there, and the table is left out rather than failing."""
    bad = tpu_host(env={**ENV, "TPU_WORKER_ID": "2"})
    assert chip_worker_envs(bad) == []
    assert "TPU_WORKER_ID=2 is not a TPU worker" in problems(diagnose(bad))[0].what


def test_rays_view_of_the_host_is_checked_against_its_env():
    host = tpu_host()
    host.ray["labels"]["ray.io/tpu-worker-id"] = "0"
    p = only_problem(host)
    assert p.what == "Ray's label ray.io/tpu-worker-id is '0'; this host's env says '1'"
    assert "restart Ray on this host" in p.fix
    host = tpu_host()
    host.ray["resources"]["TPU"] = 0
    assert "Ray's TPU resource on node abababab is 0; this host has 4 chips" in \
        only_problem(host).what
    head = tpu_host(env={**ENV, "TPU_WORKER_ID": "0"})
    head.ray["labels"]["ray.io/tpu-worker-id"] = "0"
    assert only_problem(head).what.startswith("TPU worker 0 has no TPU-v6e-8-head resource")
    head.ray["resources"]["TPU-v6e-8-head"] = 1.0
    assert problems(diagnose(head)) == []
    held = tpu_host()
    held.ray["available_tpu"] = 0.0
    assert "(4 held by actors: a reserved slice)" in diagnose(held)[3].what
    dead = tpu_host()
    dead.ray["alive"] = False
    assert [c.area for c in diagnose(dead)] == ["ray"]
    assert "dead" in only_problem(dead).what


def test_a_chip_that_does_not_open_says_why():
    held = tpu_host(opened={"ok": False, "error": "held"},
                    holders=[(4242, "python train.py")])
    p = only_problem(held)
    assert p.what == ("chip 0 did not open: another process holds the chips: pid 4242 "
                      "(python train.py)")
    assert "one process at a time opens a chip" in p.fix
    backend = tpu_host(opened={"ok": False, "error": "RuntimeError: Unable to initialize "
                                                     "backend 'tpu': ..."})
    assert "pip install -U 'jax[tpu]'" in only_problem(backend).fix
    other = tpu_host(opened={"ok": False, "error": "no answer within 5 s (--open-timeout)"})
    assert only_problem(other).what == "chip 0 did not open: no answer within 5 s " \
                                       "(--open-timeout)"


def test_a_host_that_did_not_answer_is_one_problem():
    late = HostFacts(host="v6e-2x4-1/1", versions={},
                     unreachable="host v6e-2x4-1/1 did not answer within 5 s (--timeout)")
    assert diagnose(late) == [Check("host", "problem", late.unreachable,
                                    diagnose(late)[0].fix)]
    assert "pathways-ray status" in diagnose(late)[0].fix


def test_this_machine_opens_an_emulated_chip_in_a_subprocess():
    """The real probe: versions from the installed metadata (jax's own libtpu pin),
    no chip device here, and chip 0 opened as the emulated fleet's chips are."""
    found, wanted = doctor_probe.versions()
    assert found["jax"] == found["jaxlib"]
    assert any(spec.startswith("==0.0.") for spec, _ in wanted["libtpu"]), wanted
    facts = doctor_probe.gather(open_timeout_s=60)
    assert facts.platform == "cpu" and facts.chip_paths == []
    assert facts.opened["ok"] and facts.opened["platform"] == "cpu", facts.opened
    assert problems(diagnose(facts)) == []


def test_a_process_holding_a_chip_is_found_by_its_open_file(tmp_path):
    chip = tmp_path / "accel0"
    chip.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(chip)!r}); "
                               f"print('open', flush=True); import time; time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        assert [pid for pid, _ in doctor_probe.holders([str(chip)])] == [holder.pid]
    finally:
        holder.kill()
        holder.wait(timeout=10)
    t0 = time.monotonic()
    while doctor_probe.holders([str(chip)]) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert doctor_probe.holders([str(chip)]) == []


def test_the_command_prints_a_table_and_exits_0_without_a_cluster(capsys, monkeypatch):
    from pathways_ray.cli.main import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("pathways_ray.emulation.local_fleet.running_fleets", lambda: [])
    assert main(["doctor", "--no-open"]) == 0
    out = capsys.readouterr().out
    assert "pathways-ray doctor:" in out and "not connected to a Ray cluster" in out
    assert out.rstrip().endswith("no problems on 1 host")
