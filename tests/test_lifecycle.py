"""Starting and stopping fleets: the CLI across processes, context exit, Ctrl-C.

Each test checks that every process a fleet started is gone afterwards, found
by the fleet tag every such process carries in its environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pathways_ray import LocalFleet, Slice
from tests.conftest import leftovers, ray_processes

CLI = [sys.executable, "-m", "pathways_ray.cli.main"]


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.slow
def test_cli_up_status_down_with_a_v5p_slice():
    """`up` leaves a v5p 2x2x2 fleet running for other processes; a driver attaches with
    the printed settings and runs an all-reduce; `status` shows the held slice's workers;
    `down` stops every process."""
    before = ray_processes()
    up = run_cli("up", "--slices", "1", "--accelerator", "v5p", "--topology", "2x2x2",
                 "--name", "tcli")
    assert up.returncode == 0, up.stderr
    assert "export RAY_AUTH_MODE=token" in up.stdout
    assert "v5p-16" in up.stdout
    state = json.loads((Path(os.environ["PATHWAYS_RAY_DIR"]) / "tcli" / "fleet.json").read_text())
    try:
        assert ray_processes() - before, "the fleet must outlive the `up` process"
        import ray

        from pathways_ray import Fleet, _auth

        auth_before = _auth.use_token(Path(state["token_path"]))
        fleet = Fleet.attach(state["address"])
        try:
            (view,) = fleet.slices()
            assert (view.pod_type, view.topology_name, len(view.hosts)) == ("v5p-16", "2x2x2", 2)
            with Slice.reserve("v5p-2x2x2", timeout_s=60) as s:
                assert s.num_chips == 8
                got = s.all_reduce([np.float64(r) for r in range(8)])
                assert all(float(g) == 28.0 for g in got)
                status = run_cli("status", "--name", "tcli")
                assert status.returncode == 0, status.stderr
                assert "v5p-16" in status.stdout and "(busy)" in status.stdout
                assert "ranks 0-3: 4 ok" in status.stdout and "ranks 4-7: 4 ok" in status.stdout
        finally:
            fleet.shutdown()
            assert not ray.is_initialized()
            _auth.restore(auth_before, Path(state["token_path"]))
    finally:
        down = run_cli("down", "--name", "tcli")
    assert down.returncode == 0, down.stderr
    assert "stopped fleet 'tcli'" in down.stdout
    assert leftovers(before) == []
    assert not (Path(os.environ["PATHWAYS_RAY_DIR"]) / "tcli").exists()


@pytest.mark.slow
def test_context_exit_leaves_no_process_behind():
    """Leaving the `with` block stops the raylets, agents, workers and chip actors, and
    this process no longer points Ray at the fleet's removed token file."""
    before = ray_processes()
    token_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    with LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="tctx") as fleet:
        s = Slice.reserve("v6e-2x2", timeout_s=60)
        assert s.topology.is_single_host and s.num_chips == 4
        assert len({w.info.node_id for w in s.workers}) == 1, "a single-host slice is one host"
        started = ray_processes() - before
        chip_pids = {w.info.pid for w in s.workers}
        assert chip_pids <= started and len(started) >= 4 + 6  # chips, head and host daemons
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(fleet.token_path)
    assert leftovers(before) == []
    assert not fleet.dir.exists()
    assert os.environ.get("RAY_AUTH_TOKEN_PATH") == token_path


def _default_signals() -> None:
    # A background job of a non-interactive shell (how CI may start pytest) ignores
    # SIGINT, and a child inherits that: Python would then never raise
    # KeyboardInterrupt. Give the child the default handlers, as a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop_if_left(name: str) -> None:
    """Stop fleet ``name`` if a failed test left it running, before pytest removes the
    directory its state file lives in."""
    from pathways_ray.emulation.local_fleet import running_fleets, stop_local_fleet

    if any(f.name == name for f in running_fleets()):
        stop_local_fleet(name)


def _interrupt_while(args: list[str], name: str, sig: int, ready: str, timeout_s: float):
    """Start the CLI, wait until ``ready`` shows in its output (or its head node runs,
    for ``ready=""``), send ``sig``; returns (returncode, output, leftover processes)."""
    import threading

    before = ray_processes()
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "COLUMNS": "160"},
                            preexec_fn=_default_signals)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        head_log = Path(os.environ["PATHWAYS_RAY_DIR"]) / name / "head" / "ray-start.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready and ready in "".join(lines):
                break
            if not ready and head_log.exists() and "Ray runtime started" in head_log.read_text(
                    errors="replace"):
                break
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        assert ray_processes() - before - {proc.pid}, "the fleet should be starting by now"
        proc.send_signal(sig)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("no exit 120 s after the signal:\n" + "".join(lines)) from None
        reader.join(timeout=10)
        return proc.returncode, "".join(lines), leftovers(before | {proc.pid})
    finally:
        if proc.poll() is None:
            proc.kill()
        _stop_if_left(name)


@pytest.mark.slow
def test_ctrl_c_while_starting_stops_everything():
    """SIGINT to `pathways-ray up` mid-start stops what it had started, also when the
    test runner itself was started with SIGINT ignored."""
    code, out, left = _interrupt_while(["up", "--slices", "1", "--name", "tint"], "tint",
                                       signal.SIGINT, ready="", timeout_s=120)
    assert code == 130, out
    assert "interrupted" in out
    assert left == []


@pytest.mark.slow
def test_sigterm_mid_training_stops_everything():
    """SIGTERM (what Kubernetes, Docker and systemd send) to `pathways-ray demo` while it
    trains unwinds as Ctrl-C does: exit 130, every process of its fleet stopped."""
    code, out, left = _interrupt_while(["demo", "--steps", "400", "--batch", "16"], "demo",
                                       signal.SIGTERM, ready="controller holds",
                                       timeout_s=240)
    assert code == 130, out
    assert "interrupted" in out
    assert left == []
    # A log is for reading: no colour codes into a pipe, no gloo chatter from the chips.
    assert "\x1b[" not in out and "Gloo" not in out, out


def test_free_ports_are_distinct_and_outside_the_ephemeral_range():
    """A fleet's ports are reserved together (never the same one twice), below the range
    the kernel hands out for port 0 (where Ray's own components bind), and never one
    the fleet already took."""
    from pathways_ray._procs import _ephemeral_low, free_ports

    first = free_ports(30)
    assert len(set(first)) == 30 and max(first) < _ephemeral_low()
    more = free_ports(30, exclude=first)
    assert not set(more) & set(first)


def test_processes_taking_ports_at_once_never_get_the_same_one(tmp_path):
    """Fleets started at once by different processes (two test workers, two
    `pathways-ray up`) take disjoint ports: each probe releases its port before Ray
    binds it, so only the machine-wide registry keeps them apart. 4 processes x 1,500
    ports of ~12,000 would overlap almost surely without it."""
    code = ("import json; from pathways_ray._procs import free_ports; "
            "print(json.dumps(free_ports(1500)))")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    taken = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    every = [port for ports in taken for port in ports]
    assert len(every) == len(set(every)) == 6000


def test_the_port_registry_forgets_old_and_torn_entries(tmp_path, monkeypatch):
    """A port handed out more than PORT_HOLD_S ago, or a line a crash tore, no longer
    holds anything back; a fresh one does."""
    from pathways_ray import _procs

    monkeypatch.setattr(_procs, "_port_registry", lambda: tmp_path / "ports")
    (fresh,) = _procs.free_ports(1)
    old = time.time() - _procs.PORT_HOLD_S - 1
    with open(tmp_path / "ports", "a") as f:
        f.write(f"12345@{old:.0f}\n99@x\n7@")
    _procs.free_ports(1)
    kept = (tmp_path / "ports").read_text().split()
    assert f"{fresh}@" in " ".join(kept) and not any(k.startswith(("12345@", "99@", "7@"))
                                                      for k in kept)


def test_console_into_a_pipe_is_wide_and_plain(monkeypatch):
    """Piped (not a terminal), the CLI's console does not cut tables at 80 columns."""
    from pathways_ray._ui import LOG_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()
    assert not console.is_terminal and console.width == LOG_WIDTH


@pytest.mark.parametrize(
    "args,code,text",
    [
        (["up", "--topology", "3x3"], 2, "topology='3x3' is not a v6e slice shape"),
        (["up", "--slices", "0"], 2, "'0' must be 1 or more"),
        (["up", "--accelerator", "v9"], 2, "accelerator='v9' is not a known TPU generation"),
        (["demo", "--accelerator", "v5p", "--topology", "4x4"], 2, "AxBxC (3D)"),
        (["status", "--name", "nope"], 1, "no local fleet is running"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_cli_rejects_bad_input_clearly(args, code, text):
    """Bad flags exit non-zero with a message naming the value and the fix."""
    result = run_cli(*args, timeout=60)
    assert result.returncode == code, result
    assert text in (result.stderr + result.stdout).replace("\n", " ")


def test_down_with_nothing_running():
    """`down` with no fleet says so and succeeds."""
    result = run_cli("down", timeout=60)
    assert result.returncode == 0 and "no local fleet is running" in result.stdout


def test_cli_topology_defaults():
    """A generation alone defaults to 2x4; a pod type implies its own shape."""
    from pathways_ray.cli.common import topology_of as _topology
    from pathways_ray.cli.main import build_parser

    parse = build_parser().parse_args
    assert _topology(parse(["up"])).name == "2x4"
    assert _topology(parse(["up", "--accelerator", "v6e-16"])).name == "4x4"
    assert _topology(parse(["up", "--accelerator", "v5p", "--topology", "2x2x2"])).num_hosts == 2
    assert _topology(parse(["up", "--chips-per-host", "4"])).num_hosts == 2


@pytest.mark.slow
def test_cli_chaos_against_a_running_fleet():
    """`pathways-ray chaos` on a fleet left running by `up`: a bad host is named with the
    hosts there are; kill-host takes a host down for real (`status` shows it dead) and
    restore-host brings a new one; freeze-host stops every process of a host and
    thaw-host resumes them; `status --watch` redraws until Ctrl-C. Nothing is left."""
    import psutil


    before = ray_processes()
    up = run_cli("up", "--slices", "2", "--topology", "2x2", "--name", "tchaos")
    assert up.returncode == 0, up.stderr
    env = {**os.environ, "COLUMNS": "160"}
    env.pop("RAY_ADDRESS", None)
    watch = subprocess.Popen(CLI + ["status", "--name", "tchaos", "--watch", "0.5"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env)
    try:
        bad = run_cli("chaos", "kill-host", "v6e-2x2-7", "--name", "tchaos")
        assert bad.returncode == 2 and "no host slice_name='v6e-2x2-7'" in bad.stderr, bad.stderr
        assert "v6e-2x2-1/0" in bad.stderr

        kill = run_cli("chaos", "kill-host", "v6e-2x2-1", "--name", "tchaos")
        assert kill.returncode == 0, kill.stderr
        assert "killed host v6e-2x2-1/0 of fleet 'tchaos'" in kill.stdout
        deadline = time.monotonic() + 30
        while "dead" not in (status := run_cli("status", "--name", "tchaos")).stdout:
            assert time.monotonic() < deadline, status.stdout + status.stderr
            time.sleep(1)
        restore = run_cli("chaos", "restore-host", "v6e-2x2-1", "--name", "tchaos")
        assert restore.returncode == 0, restore.stderr

        freeze = run_cli("chaos", "freeze-host", "v6e-2x2-0", "--name", "tchaos")
        assert freeze.returncode == 0, freeze.stderr
        from pathways_ray.emulation.local_fleet import LocalFleet

        fleet = LocalFleet.running("tchaos")
        procs = fleet.host_processes("v6e-2x2-0", 0)
        assert procs and {p.status() for p in procs} == {psutil.STATUS_STOPPED}
        thaw = run_cli("chaos", "thaw-host", "v6e-2x2-0", "--name", "tchaos")
        assert thaw.returncode == 0, thaw.stderr
        assert psutil.STATUS_STOPPED not in {p.status() for p in procs if p.is_running()}

        watch.send_signal(signal.SIGINT)
        out = watch.communicate(timeout=60)[0]
        assert watch.returncode == 130 and "pathways-ray fleet" in out, out
    finally:
        if watch.poll() is None:
            watch.kill()
        down = run_cli("down", "--name", "tchaos")
    assert down.returncode == 0, down.stderr
    assert leftovers(before) == []


@pytest.mark.slow
def test_main_job_trains_through_a_lost_host_and_cleans_up(tmp_path):
    """`pathways-ray demo --chaos` in small (the main job, plus a failure): a host of the
    last slice is killed a third of the way in; every step still yields a loss and the
    loss falls, the status table and summary are printed, the events are in the summary
    and on the plot, and nothing is left."""
    from rich.console import Console

    from pathways_ray.demo import run_demo

    before = ray_processes()
    console = Console(record=True, width=120)
    result = run_demo(steps=9, batch=16, out_dir=tmp_path, console=console, chaos=True)
    text = console.export_text()
    kinds = [e.kind for e in result.events]
    assert kinds[:2] == ["slice_lost", "step_retried"], kinds
    victim = result.events[0].slice
    assert result.events[0].step == 3
    assert len(result.losses) == 9 and result.losses[-1] < result.losses[0]
    assert f"chaos: killed host {victim}/0 before step 4" in text
    assert f"slice lost: {victim}" in text
    assert "controller holds" in text and "ranks 0-3: 4 ok" in text and "summary" in text
    assert result.plot.exists() and result.plot.stat().st_size > 10_000
    assert leftovers(before) == []
