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

import pytest

_DIR = tempfile.mkdtemp(prefix="pwr-", dir="/tmp")
os.environ["PATHWAYS_RAY_DIR"] = _DIR


@pytest.fixture(scope="session", autouse=True)
def _fleet_dir():
    yield _DIR
    shutil.rmtree(_DIR, ignore_errors=True)


def fleet_processes(fleet_id_prefix: str = "") -> list:
    """Live processes started by any fleet whose id starts with ``fleet_id_prefix``."""
    import psutil

    from pathways_ray import _procs

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            tag = proc.environ().get(_procs.FLEET_ENV)
            if tag and tag.startswith(fleet_id_prefix) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found
