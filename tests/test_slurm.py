"""`pathways-ray slurm` against a real Slurm: munged, slurmctld and slurmd started here.

Debian's packages (`slurmd slurmctld slurm-client munge`; `./run.sh test` installs
them where it can). Without them the Slurm tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pathways_ray._procs import free_ports
from pathways_ray.clusters.slurm import SlurmJob, render_sbatch
from pathways_ray.clusters.topology import Topology
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
V6E_2X2 = Topology.parse("v6e", "2x2")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol")


# ---- the script (pure) ------------------------------------------------------------------
def test_script_is_valid_bash_and_names_what_it_runs(tmp_path):
    job = SlurmJob(("python", "train.py", "--steps", "5"), (V6E_2X2, V6E_2X2), nodes=2,
                   partition="tpu", output="/logs/%j.out")
    script = render_sbatch(job)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    for line in ("#SBATCH --nodes=2", "#SBATCH --partition=tpu", "#SBATCH --output=/logs/%j.out",
                 "--slices v6e-2x2@4,v6e-2x2@4 --nodes 2", "--chips 8",
                 "-- python train.py --steps 5"):
        assert line in script


@pytest.mark.parametrize("kw, match", [
    ({"command": ()}, "command=.* is empty"),
    ({"nodes": 3}, "nodes=3 is more than the 2 TPU hosts"),
    ({"time_limit": "1 hour"}, "time_limit='1 hour' is not a Slurm time"),
    ({"port": 80}, "port=80 is not a port"),
    ({"job_name": "a b"}, "job_name='a b'"),
])
def test_bad_settings_are_named(kw, match):
    args = {"command": ("python", "t.py"), "slices": (V6E_2X2, V6E_2X2), **kw}
    with pytest.raises(ValueError, match=match):
        SlurmJob(**args)


# ---- a real Slurm -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [d for d in DAEMONS if not shutil.which(d)]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"Slurm is not installed ({missing}); ./run.sh test installs it")
        pytest.skip(f"Slurm is not installed ({missing}): apt-get install slurmd slurmctld "
                    f"slurm-client munge")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    # munged wants every directory above its socket open to all (pytest's are 0700)
    m = Path(tempfile.mkdtemp(prefix="pwr-munge-"))
    m.chmod(0o755)
    key = m / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    ctl_port, node_port = free_ports(2)
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=pwrtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmdPort={node_port}
AuthType=auth/munge
AuthInfo=socket={m}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    procs = [subprocess.Popen(
        ["munged", "-F", f"--key-file={key}", f"--socket={m}/munge.sock",
         f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
         f"--seed-file={m}/seed"], env=env, stderr=subprocess.DEVNULL)]
    time.sleep(0.5)
    procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    procs.append(subprocess.Popen(["slurmd", "-D", "-N", host], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                 text=True).stdout.strip()
            if out == "idle":
                break
            if time.monotonic() > deadline:
                logs = "".join(p.read_text()[-2000:] for p in d.glob("*.log"))
                pytest.fail(f"Slurm did not come up within 60 s (sinfo: {out!r})\n{logs}")
            time.sleep(0.5)
        yield env, d
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(m, ignore_errors=True)


def _job(env, d: Path, steps: int) -> tuple[str, Path]:
    """Write the script with the CLI and sbatch it from the repository (the submit dir)."""
    log = d / f"job-{steps}.out"
    script = d / f"train-{steps}.sbatch"
    port, dash = free_ports(2)
    subprocess.run([sys.executable, "-m", "pathways_ray.cli.main", "slurm", "--slices", "2",
                    "--topology", "2x2", "--log", str(log), "--port", str(port),
                    "--dashboard-port", str(dash), "--state-dir", str(d / "jobs"), "-o",
                    str(script), "--", "python", "examples/train_jax_lm.py", "--mode",
                    "single_controller", "--steps", str(steps), "--storage-path",
                    str(d / "runs")], env=env, check=True, cwd=ROOT)
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0], log


def _state(env, job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True,
                         text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def _job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process started for the job (they all carry SLURM_JOB_ID)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("SLURM_JOB_ID") == job_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _ray_temp_dirs() -> set[Path]:
    """The Ray temp dirs (session logs) the node helpers made: pwr-head-*, pwr-v6e-*."""
    tmp = Path(tempfile.gettempdir())
    return {*tmp.glob("pwr-head-*"), *tmp.glob("pwr-v6e-*")}


def _wait_until(cond, timeout_s: float, what: str):
    return wait_until(cond, timeout_s, what, every_s=1)


@pytest.mark.slow
def test_sbatch_runs_the_demo_training_to_completion(slurm):
    env, d = slurm
    temp_before = _ray_temp_dirs()
    job_id, log = _job(env, d, steps=5)
    state = _wait_until(lambda: (s := _state(env, job_id)).get("JobState") in (
        "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s, 420, "the job did not end")
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", text[-3000:]
    assert re.search(r"final loss \d+\.\d+ after 5 steps", text), text[-3000:]
    assert "succeeded" in text
    _wait_until(lambda: not _job_processes(job_id), 60, "Ray processes outlived the job")
    assert not any((d / "jobs").glob("*")), "the job's token was left behind"
    assert not _ray_temp_dirs() - temp_before, "the node helpers left Ray's temp dirs behind"


@pytest.mark.slow
def test_scancel_mid_run_leaves_no_ray_process(slurm):
    env, d = slurm
    job_id, log = _job(env, d, steps=100_000)
    _wait_until(lambda: log.exists() and "Started training worker group" in log.read_text(),
                300, "training did not start")
    assert any("raylet" in " ".join(p.cmdline()) for p in _job_processes(job_id))
    subprocess.run(["scancel", job_id], env=env, check=True)
    _wait_until(lambda: not _job_processes(job_id), 90, "Ray processes outlived scancel")
    # slurmctld shows COMPLETING until slurmd reports the step's end: wait that out
    state = _wait_until(lambda: (s := _state(env, job_id)).get("JobState") != "COMPLETING" and s,
                        60, "the job stayed COMPLETING after scancel")
    assert state.get("JobState") == "CANCELLED", state
