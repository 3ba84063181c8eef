"""JAX clients of their own environments through one proxy (1 emulated v6e 2x2 slice),
as Cloud Pathways serves "JAX 0.10.1+" clients from one server: jaxlib 0.10.2 (on
Python 3.11) and 0.12.1 each speak their own protocol version (25, 28) and train the
same steps with local JAX's losses; MaxText 0.2.5 from PyPI pre-trains, checkpoints and
resumes, unmodified, with the losses it has on 4 local CPU devices. The client
environments are made on first use and cached (``tests/client_envs.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import proxy_scripts
from tests.client_envs import client_python
from tests.test_proxy import _env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def proxy():
    from pathways_ray import LocalFleet
    from pathways_ray.proxy.server import ProxyServer

    with LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="tclients",
                    log_to_driver=False) as fleet:
        with ProxyServer(["v6e-2x2"]) as server:
            server.fleet = fleet
            yield server
        assert server.sessions == 0


def _run(python, source: str, server=None, timeout_s: float = 600) -> dict:
    out = subprocess.run([str(python), "-c", source], capture_output=True, text=True,
                         timeout=timeout_s, env=_env(server))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


def test_clients_of_jax_0_10_and_0_12_train_alike_through_one_proxy(proxy, monkeypatch):
    from pathways_ray.proxy import versions

    chosen = []
    negotiate = versions.negotiate
    monkeypatch.setattr(versions, "negotiate",
                        lambda low, high: chosen.append(negotiate(low, high)) or chosen[-1])
    old = _run(client_python("jax-0.10.2"), proxy_scripts.TRAIN_ONE_SLICE, proxy)
    new = _run(sys.executable, proxy_scripts.TRAIN_ONE_SLICE, proxy)
    want = _run(sys.executable, proxy_scripts.TRAIN_ONE_SLICE)
    assert (old["jax"], new["jax"]) == ("0.10.2", "0.12.1")
    assert old["n"] == new["n"] == 4
    assert set(chosen) == {25, 28}, chosen  # each client at its own protocol version
    np.testing.assert_allclose(old["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(new["losses"], want["losses"], rtol=1e-5)


MAXTEXT_ARGS = ("dataset_type=synthetic", "steps=5", "enable_checkpointing=false",
                "base_emb_dim=64", "base_num_query_heads=2", "base_num_kv_heads=2",
                "base_mlp_dim=128", "base_num_decoder_layers=2", "head_dim=32",
                "vocab_size=256", "max_target_length=64", "per_device_batch_size=1",
                "skip_jax_distributed_system=true")


def maxtext_command(python: Path, out: Path, *args: str) -> list[str]:
    """MaxText's pre-training trainer, as its README runs it (a key of ``args`` replaces
    ours)."""
    given = {a.split("=", 1)[0] for a in args}
    base = subprocess.run([str(python), "-c", "import maxtext, os; print(os.path.join("
                           "os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))"],
                          capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    return [str(python), "-m", "maxtext.trainers.pre_train.train", base, "run_name=t",
            f"base_output_directory={out}", f"metrics_file={out / 'metrics.jsonl'}",
            *(a for a in MAXTEXT_ARGS if a.split("=", 1)[0] not in given), *args]


def maxtext(python: Path, out: Path, env: dict, *args: str, timeout_s: float = 900) -> list:
    """MaxText's pre-training trainer run to its end; returns its losses."""
    metrics = out / "metrics.jsonl"
    run = subprocess.run(maxtext_command(python, out, *args), capture_output=True, text=True,
                         timeout=timeout_s, env=env, cwd=out)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return [json.loads(ln)["learning/loss"] for ln in metrics.read_text().splitlines()]


def test_maxtext_from_pypi_pretrains_one_slice_through_the_proxy_and_resumes(proxy, tmp_path):
    """MaxText's own pre-train trainer (synthetic data, a tiny model) through the proxy on
    one slice's 4 chips: 3 steps that checkpoint (Orbax, with
    ``ENABLE_PATHWAYS_PERSISTENCE=1`` as a Cloud Pathways user sets it), then a second
    run that restores the last checkpoint and goes on to step 5. Its 5 losses are the
    ones an uninterrupted 5-step run has on 4 local CPU devices. (MaxText 0.2.5's
    pre-train trainer stages its checkpoints through the controller with or without the
    variable: its checkpoint context picks Orbax's controller-side handler, as its own
    comment says, so the path is the same one.)"""
    python = client_python("maxtext")
    (tmp_path / "proxy").mkdir()
    (tmp_path / "local").mkdir()
    env = {**{k: v for k, v in _env(proxy).items() if k != "XLA_FLAGS"},
           "ENABLE_PATHWAYS_PERSISTENCE": "1"}
    ckpt = ("enable_checkpointing=true", "async_checkpointing=false",
            "learning_rate_schedule_steps=5")  # the schedule of the whole 5 steps
    first = maxtext(python, tmp_path / "proxy", env, "steps=3", *ckpt)
    assert sorted(p.name for p in (tmp_path / "proxy" / "t" / "checkpoints").iterdir()) == [
        "0", "2"]  # at the start and at the end of the run
    both = maxtext(python, tmp_path / "proxy", env, "steps=5", *ckpt)  # (appends metrics)
    local = maxtext(python, tmp_path / "local", _env(None))
    assert len(first) == 3 and len(both) == len(local) == 5
    np.testing.assert_allclose(both, local, rtol=1e-5)
