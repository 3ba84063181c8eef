"""Two emulated fleets on one machine never touch each other's processes.

Host names repeat across fleets (every fleet of 2x2 slices has a host
``v6e-2x2-0/0``); fault injection and ``down`` select a host's processes by its
fleet's id as well (``_procs.find``), so a kill meant for one fleet cannot reach
another's chips, as it once did.
"""

from __future__ import annotations

import numpy as np
import psutil
import pytest

from pathways_ray import LocalFleet, _procs, connect
from tests.conftest import leftovers, ray_processes
from tests.test_lifecycle import run_cli

pytestmark = pytest.mark.slow


def _alive(fleet: LocalFleet) -> dict[int, str]:
    """pid -> status of every live process of ``fleet``."""
    out = {}
    for p in _procs.find(fleet.fleet_id, fleet._state.all_sessions()):
        try:
            out[p.pid] = p.status()
        except psutil.NoSuchProcess:
            continue
    return out


def test_kill_freeze_restore_and_down_stay_inside_their_fleet():
    """Fleets "tiso-a" and "tiso-b" both have slice v6e-2x2-0. Killing, freezing,
    thawing and restoring b's host v6e-2x2-0/0 and then `down --name tiso-b`, all
    through the CLI, leave every process of a alive and running (the same pids, none
    stopped), and a's client steps after each; the CLI names the fleet it acted on.
    A host that b does not have is an error naming b."""
    before = ray_processes()
    with LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="tiso-a",
                    log_to_driver=False) as a:
        b = LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="tiso-b",
                       connect=False)
        b.start()
        try:
            assert set(a.slice_names()) == set(b.slice_names()) == {"v6e-2x2-0"}
            with connect() as client:  # a session of fleet a, on its chips
                from jax.sharding import NamedSharding
                from jax.sharding import PartitionSpec as P

                mesh = client.mesh((4,), ("data",))
                x = client.device_put(np.arange(8, dtype=np.float32),
                                      NamedSharding(mesh, P("data")))
                step = client.jit(lambda v: v * 2 + 1)
                np.testing.assert_array_equal(step(x).fetch(), np.arange(8) * 2 + 1)
                a_procs = _alive(a)
                assert len(a_procs) > 10 and "ChipWorker" in " ".join(
                    " ".join(psutil.Process(pid).cmdline()) for pid in a_procs)
                b_host = {p.pid for p in b.host_processes("v6e-2x2-0", 0)}
                assert b_host and not b_host & set(a_procs)

                def act(*args: str) -> str:
                    out = run_cli("chaos", *args, "v6e-2x2-0", "--name", "tiso-b")
                    assert out.returncode == 0, out.stderr
                    # Nothing of fleet a moved: same processes, none stopped.
                    now = _alive(a)
                    assert set(a_procs) <= set(now), f"{args[0]} on b killed a's " \
                        f"{sorted(set(a_procs) - set(now))}"
                    assert psutil.STATUS_STOPPED not in {now[p] for p in a_procs}, args
                    np.testing.assert_array_equal(step(x).fetch(), np.arange(8) * 2 + 1)
                    return out.stdout

                said = act("freeze-host")
                assert f"froze host v6e-2x2-0/0 of fleet 'tiso-b' ({b.fleet_id}" in said
                assert {p.status() for p in b.host_processes("v6e-2x2-0", 0)} == {
                    psutil.STATUS_STOPPED}
                act("thaw-host")
                said = act("kill-host")
                assert f"killed host v6e-2x2-0/0 of fleet 'tiso-b' ({b.fleet_id}" in said
                assert b.host_processes("v6e-2x2-0", 0) == []
                said = act("restore-host")
                assert "restored host v6e-2x2-0/0 of fleet 'tiso-b'" in said
                assert b.host_processes("v6e-2x2-0", 0)

                wrong = run_cli("chaos", "kill-host", "v6e-2x2-7", "--name", "tiso-b")
                assert wrong.returncode != 0 and "fleet 'tiso-b'" in wrong.stderr, wrong.stderr

                down = run_cli("down", "--name", "tiso-b")
                assert down.returncode == 0, down.stderr
                assert f"stopped fleet 'tiso-b' ({b.fleet_id}" in down.stdout
                assert _alive(b) == {}
                now = _alive(a)
                assert set(a_procs) <= set(now)
                np.testing.assert_array_equal(step(x).fetch(), np.arange(8) * 2 + 1)
        finally:
            b.shutdown()
    assert leftovers(before) == []
