"""MaxText's own elastic training through the IFRT proxy: a slice lost and restored
under it, on 2 emulated v6e 2x2 slices.

    python benchmarks/proxy_maxtext_elastic.py

MaxText 0.2.5 (``elastic_enabled=true``, at least 1 slice; checkpoints every 5 steps
on local disk, ``DECOUPLE_GCLOUD=TRUE`` as MaxText runs off Google Cloud) trains data
parallel across both slices through ``ProxyServer``. A host of slice 1 is killed for
real (``LocalFleet.remove_host``): MaxText re-meshes and goes on on slice 0; the host
is restored: it scales back to both slices, resuming from the checkpoint it wrote on
slice 0 alone. Checked (exits 1 naming what did not happen): the active slices MaxText
reports go {0, 1} -> {0} -> {0, 1}, and it resumed from a checkpoint. Printed: kill ->
the first step on slice 0 alone, restore -> the first step on both again, and the run's
whole time. (It was a test of the suite until its 190-575 s outweighed what it adds to
``tests/test_proxy.py``'s pathwaysutils elastic test, which takes the same server path
in ~56 s; this keeps it runnable.) The MaxText client venv is
``tests/client_envs.py``'s (made on first use).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def elastic_run(server, fleet, out: Path, timeout_s: float = 420) -> dict:
    """Run MaxText elastic through ``server`` while a host of slice 1 dies and comes
    back; returns what MaxText said and when (raises ``RuntimeError`` naming a phase
    that did not happen within ``timeout_s``)."""
    from tests.client_envs import client_python
    from tests.test_proxy_clients import maxtext_command
    from tests.waiting import wait_until

    python = client_python("maxtext")
    env = {**{k: v for k, v in os.environ.items()
              if not k.startswith(("RAY_", "XLA_FLAGS", "JAX_"))},
           **server.exports, "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS": "60",
           "DECOUPLE_GCLOUD": "TRUE"}
    cmd = maxtext_command(python, out, "steps=2000", "elastic_enabled=true",
                          "enable_single_controller=true",
                          "elastic_min_slice_count=1", "elastic_timeout_seconds=300",
                          "enable_checkpointing=true", "checkpoint_period=5",
                          "async_checkpointing=false", "dcn_data_parallelism=-1",
                          "ici_fsdp_parallelism=4")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=out)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def steps_on(n: int, after: int = 0) -> int:
        return sum(1 for ln in list(lines)[after:]
                   if "completed step:" in ln and f"live slice count: {n}" in ln)

    def wait(cond, what: str) -> int:
        wait_until(lambda: cond() or proc.poll() is not None, timeout_s, what)
        if proc.poll() is not None:
            raise RuntimeError(f"MaxText exited ({what}): " + "".join(
                [ln for ln in lines if ln[:1] not in "IWE" or not ln[1:5].isdigit()][-60:]))
        return len(lines)

    times = {}
    try:
        wait(lambda: steps_on(2) >= 3, "MaxText did not train on both slices")
        t = time.monotonic()
        fleet.remove_host("v6e-2x2-1", 0)
        seen = wait(lambda: steps_on(1) >= 1, "MaxText did not go on on slice 0 alone")
        times["kill -> a step on slice 0 alone (s)"] = time.monotonic() - t
        wait(lambda: steps_on(1) >= 2, "MaxText did not go on on slice 0 alone")
        t = time.monotonic()
        fleet.restore_host("v6e-2x2-1", 0)
        wait(lambda: steps_on(2, seen) >= 1, "MaxText did not scale back to both slices")
        times["restore -> a step on both slices (s)"] = time.monotonic() - t
        wait(lambda: steps_on(2, seen) >= 2, "MaxText did not scale back to both slices")
        times["whole run (s)"] = time.monotonic() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(10)
        (out / "maxtext.log").write_text("".join(lines))
    said = [ln.split("] ", 1)[-1].strip() for ln in lines]
    active = [ln.split("Active indices: ")[1] for ln in said if "Active indices: " in ln]
    resumed = [int(ln.rsplit(" ", 1)[1]) for ln in said
               if ln.startswith("restoring from this run's directory step")]
    first_back = next((int(ln.split(",")[0].split(": ")[1]) for ln in said[seen:]
                       if ln.startswith("completed step:") and "live slice count: 2" in ln), -1)
    return {"active": active[:3], "elastic_event": "Elastic event detected" in said,
            "scale_up": "Scale up requested." in said, "resumed": resumed,
            "first_back": first_back, "times": times}


def main() -> None:
    from pathways_ray import LocalFleet
    from pathways_ray.proxy.server import ProxyServer

    with tempfile.TemporaryDirectory() as tmp, LocalFleet(
            num_slices=2, accelerator="v6e", topology="2x2", name="bmtelastic",
            log_to_driver=False) as fleet:
        server = ProxyServer(["v6e-2x2", "v6e-2x2"])
        server.fleet = fleet
        server.start()
        try:
            got = elastic_run(server, fleet, Path(tmp))
        finally:
            server.stop()
    for k, v in got["times"].items():
        print(f"{k:>40}: {v:7.1f}")
    print(f"active slices: {got['active']}; resumed from steps {got['resumed']}, first step "
          f"back on both slices: {got['first_back']}")
    ok = (got["active"] == ["frozenset({0, 1})", "frozenset({0})", "frozenset({0, 1})"]
          and got["elastic_event"] and got["scale_up"] and len(got["resumed"]) >= 2
          and got["first_back"] >= got["resumed"][-1] > 0)
    if not ok:
        sys.exit(f"MaxText elastic did not go as expected: {got}")
    print("MaxText went on without slice 1 and scaled back from its checkpoint: as expected")


if __name__ == "__main__":
    main()
