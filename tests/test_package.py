"""Package boundaries: what importing pathways_ray pulls in."""

from __future__ import annotations

import subprocess
import sys


def test_import_is_light_and_core_never_imports_the_optional_parts():
    """`import pathways_ray` imports no torch, vllm, ray.serve, kuberay code (nor JAX,
    which chip workers and the client load only when they first need it)."""
    code = ("import sys, pathways_ray; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'vllm', 'kubernetes', 'jax'}), [m for m in sys.modules if "
            "m.startswith(('ray.serve', 'pathways_ray.kuberay', 'pathways_ray.trainers', "
            "'pathways_ray.serve'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[] []", out


def test_public_names():
    """The public API is re-exported from the package."""
    import pathways_ray as pr

    for name in ("Topology", "LocalFleet", "Fleet", "Slice", "connect", "reshard",
                 "RemoteArray", "Controller", "RemoteError", "ReservationTimeout"):
        assert name in pr.__all__ and hasattr(pr, name), name


def test_trainers_import_torch_only_when_asked():
    """`pathways_ray.trainers` serves JAX users without torch; TorchTrainer loads it."""
    code = ("import sys, pathways_ray.trainers as t; before = 'torch' in sys.modules; "
            "t.TorchTrainer; print(before, 'torch' in sys.modules, sorted(t.__all__)[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, check=True).stdout.strip()
    assert out == "False True ['Checkpoint', 'CheckpointConfig', 'FailureConfig']", out
