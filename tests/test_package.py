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
    """The names a user needs are re-exported from the package (loaded on first use);
    names of earlier releases still resolve; a typo says what is missing."""
    import pytest

    import pathways_ray as pr

    for name in ("Topology", "LocalFleet", "Fleet", "Slice", "connect", "reshard", "Client",
                 "RemoteArray", "RemoteError", "ReservationTimeout", "SliceLost",
                 "ControllerDied", "WorkerDied", "WaitTimeout", "PathwaysError"):
        assert name in pr.__all__ and hasattr(pr, name), name
    assert len(pr.__all__) <= 20
    from pathways_ray.controller import Controller

    assert pr.Controller is Controller and "Controller" not in pr.__all__
    with pytest.raises(AttributeError, match="no attribute 'conect'"):
        pr.conect  # noqa: B018


def _without(package: str, code: str, timeout_s: float = 180) -> str:
    """Run ``code`` in a fresh interpreter where ``package`` (and its submodules) cannot
    be imported, as on a machine without it; returns its output."""
    block = ("import sys, importlib.abc\n"
             "class Missing(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             f"        if name == {package!r} or name.startswith({package + '.'!r}):\n"
             "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
             "sys.meta_path.insert(0, Missing())\n")
    out = subprocess.run([sys.executable, "-c", block + code], capture_output=True,
                         text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_pure_modules_import_without_ray():
    """With Ray unimportable, the package, its pure modules and KubeRay rendering still
    import and work; connecting fails with Ray's own ImportError."""
    out = _without("ray", (
        "import pathways_ray, pathways_ray.topology, pathways_ray.errors, pathways_ray.config\n"
        "import pathways_ray.cluster, pathways_ray.sharding, pathways_ray.commands\n"
        "import pathways_ray.program, pathways_ray.worker_env\n"
        "from pathways_ray.kuberay import manifests\n"
        "print(pathways_ray.Topology.of('v6e-4x4').pod_type, 'ray' in sys.modules)\n"
        "try:\n"
        "    pathways_ray.connect()\n"
        "except ImportError as e:\n"
        "    print('connect:', e)\n"))
    assert out.splitlines() == ["v6e-16 False", "connect: No module named 'ray'"], out


def test_torch_trainer_without_torch_names_the_extra():
    """Without PyTorch, asking for TorchTrainer says which extra to install (Ray's own
    message says only "pip install torch")."""
    out = _without("torch", (
        "import pathways_ray.trainers as t\n"
        "try:\n"
        "    from pathways_ray.trainers import TorchTrainer\n"
        "except ImportError as e:\n"
        "    print(e)\n"))
    assert "pip install 'pathways-ray[torch]'" in out, out


def test_the_runtime_never_imports_the_emulator():
    """Only the CLI, the demo and the local-fleet modules import ``local_fleet``: the
    runtime (client, controller, slices, serving, trainers) runs the same on TPUs."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    allowed = {"pathways_ray/cli.py", "pathways_ray/demo/run.py", "pathways_ray/__init__.py",
               "pathways_ray/local_fleet.py", "pathways_ray/chaos.py", "serve/cli.py",
               "trainers/cli.py"}
    offenders = []
    for folder in ("pathways_ray", "serve", "trainers", "kuberay"):
        for path in (root / folder).rglob("*.py"):
            rel = str(path.relative_to(root))
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any("local_fleet" in n for n in names) and rel not in allowed:
                    offenders.append(rel)
    assert offenders == []


def test_trainers_import_torch_only_when_asked():
    """`pathways_ray.trainers` serves JAX users without torch; TorchTrainer loads it."""
    code = ("import sys, pathways_ray.trainers as t; before = 'torch' in sys.modules; "
            "t.TorchTrainer; print(before, 'torch' in sys.modules, sorted(t.__all__)[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, check=True).stdout.strip()
    assert out == "False True ['Checkpoint', 'CheckpointConfig', 'FailureConfig']", out


def test_sigterm_during_an_import_waits_for_the_import(tmp_path):
    """SIGTERM (or Ctrl-C) that lands while a module is imported is raised once the
    import is done: raised inside it, it can cross a native extension's init (jaxlib's
    nanobind aborts the process on it; seen in CI during ``import jax``)."""
    (tmp_path / "slow_mod.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.5)\ndone = True\n")
    code = ("import sys, time\nfrom pathways_ray.cli import handle_sigterm_as_interrupt, "
            "Terminated\nhandle_sigterm_as_interrupt()\ntry:\n    import slow_mod\n"
            "    time.sleep(10)\n    print('not interrupted')\nexcept Terminated:\n"
            "    print('terminated after import', sys.modules['slow_mod'].done)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert out.stdout.strip() == "terminated after import True", out.stdout + out.stderr
