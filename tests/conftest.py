"""Shared test setup.

Fleets keep their state under a private ``PATHWAYS_RAY_DIR`` for the whole
session (short, because Ray's Unix socket paths live below it), so tests never
touch a fleet a developer has running. Every test module that needs a cluster
starts one fleet and shares it between its tests.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

_DIR = tempfile.mkdtemp(prefix="pwr-", dir="/tmp")
os.environ["PATHWAYS_RAY_DIR"] = _DIR
# The test process is the reference single-process JAX run: 8 fake CPU devices. Chip
# workers started by fleets inherit this and must still each get exactly one device.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"


# Seconds per test module (setup, calls and teardown, its fleet's start and stop
# included): CI's budget is spent module by module, so its log says where.
_MODULE_S: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _MODULE_S[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    slow = sorted(_MODULE_S.items(), key=lambda kv: -kv[1])[:20]
    if not slow or slow[0][1] < 60:
        return
    terminalreporter.write_sep("=", f"slowest modules (of {sum(_MODULE_S.values()):.0f} s)")
    for module, seconds in slow:
        terminalreporter.write_line(f"{seconds:8.1f}s {module}")


# The suite runs as two pytest-xdist workers, a module at a time each (``./run.sh
# test``: ``-n 2 --dist loadfile``); modules are handed out in collection order, so
# the longest go first (their fresh-clone CI seconds, serial) and the short ones
# fill in at the end. A module not listed runs after these.
SLOW_FIRST = ("test_trainers", "test_proxy", "test_elastic", "test_serve",
              "test_proxy_clients", "test_lifecycle", "test_failures", "test_slurm",
              "test_rl", "test_controller", "test_proxy_hardening", "test_checkpoint",
              "test_sidecar", "test_service", "test_fleet", "test_multislice",
              "test_smoke", "test_fleet_isolation")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.split("::")[0]).stem,
                                         len(rank)))  # stable: tests keep their order


@pytest.fixture(scope="session", autouse=True)
def _fleet_dir():
    yield _DIR
    shutil.rmtree(_DIR, ignore_errors=True)


def ray_processes() -> set[int]:
    """Pids of every Ray-looking process on the machine that is not another test
    process's (nor this one).

    Matches by command line, not by environment: Ray's agents rename
    themselves with setproctitle, which wipes their /proc environ. The suite
    runs as two pytest processes at once (``./run.sh test``), each with its own
    ``PATHWAYS_RAY_DIR``, which every process it starts inherits: a process
    whose environment names another dir is the other's, and so is a renamed one
    in the same session (every ``ray start`` leads a session of its own).
    """
    import psutil

    from pathways_ray._procs import _looks_like_ray

    # Under xdist the controller and the workers are this process's parent and
    # siblings; a worker's title names its test ("test_kuberay_...": "ray" in it).
    skip = {os.getpid()}
    if os.environ.get("PYTEST_XDIST_WORKER"):
        parent = psutil.Process(os.getppid())
        skip |= {parent.pid, *(c.pid for c in parent.children())}
    owner: dict[int, str | None] = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid in skip or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if _looks_like_ray(proc):
                owner[proc.pid] = _dir_of(proc)
        except psutil.Error:
            continue
    foreign = {_sid(pid) for pid, d in owner.items() if d not in (None, _DIR)}
    return {pid for pid, d in owner.items()
            if d == _DIR or (d is None and _sid(pid) not in foreign)}


def _dir_of(proc) -> str | None:
    import psutil

    try:
        return proc.environ().get("PATHWAYS_RAY_DIR")
    except psutil.Error:
        return None


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def leftovers(before: set[int], timeout_s: float = 10.0) -> list[str]:
    """Ray processes that appeared since ``before`` and are still alive after ``timeout_s``."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        new = ray_processes() - before
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = []
    for pid in sorted(new):
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            continue
    return out
