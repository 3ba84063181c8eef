"""Package boundaries: what importing pathways_ray pulls in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
    from pathways_ray.controller.controller import Controller

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
        "import pathways_ray, pathways_ray.clusters.topology, pathways_ray.errors\n"
        "import pathways_ray.config, pathways_ray.clusters.cluster\n"
        "import pathways_ray.programs.sharding, pathways_ray.transport.commands\n"
        "import pathways_ray.programs.program, pathways_ray.chips.worker_env\n"
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


# Each subsystem of the runtime and what it may import, lowest first; a subsystem may
# import itself and the ones it lists. "base" is the package's top-level modules
# (errors, config, boundary, _auth, _procs, _ui). The runtime (every subsystem but
# emulation and the apps) imports no emulation, serve, trainers or kuberay code, so it
# runs the same on real TPUs; the top-level parts (serve/, trainers/, kuberay/) use
# the package, never the reverse.
_RUNTIME = ("base", "clusters", "programs", "observability", "transport", "chips",
            "controller", "service", "client", "storage", "elastic")
LAYERS = {
    "base": (),
    "clusters": ("base",),
    "programs": ("base",),
    "observability": ("base", "clusters"),
    "transport": ("base", "programs", "observability"),
    "chips": ("base", "clusters", "programs", "observability", "transport"),
    "controller": ("base", "clusters", "programs", "observability", "transport", "chips"),
    "service": _RUNTIME[:7],
    "client": _RUNTIME[:8],
    "storage": _RUNTIME[:9],
    "elastic": _RUNTIME[:10],
    "emulation": _RUNTIME,
    # the IFRT proxy server: a client of the runtime, for unmodified JAX programs
    "proxy": _RUNTIME,
    # the apps: the CLI, the demo and the hooks for tests may use the emulated fleet
    "cli": (*_RUNTIME, "emulation", "demo", "proxy"),
    "demo": (*_RUNTIME, "emulation"),
    "testing": _RUNTIME,
    "package": _RUNTIME,  # pathways_ray/__init__.py: the public names, loaded lazily
    # the parts outside the runtime, each its own top-level folder
    "trainers": (*_RUNTIME, "demo"),  # TorchTrainer's LM example model is the demo's
    "serve": (*_RUNTIME, "trainers", "cli"),  # its commands join the CLI's
    "kuberay": ("base", "clusters", "serve"),  # an LLM service's replicas: serve.plan (pure)
}
BASE = {"__init__", "errors", "config", "boundary", "_auth", "_procs", "_ui"}
# A part outside the runtime may start the emulated fleet from its CLI command only.
EMULATION_USERS = {"serve/cli.py", "trainers/cli.py"}


def _subsystem(name: str) -> str | None:
    """The subsystem of a dotted module name of this project (None: not ours)."""
    import pathways_ray

    parts = name.split(".")
    if parts[0] != "pathways_ray":
        return None
    if len(parts) == 1 or parts[1] in BASE:
        return "base"
    root = Path(pathways_ray.__file__).parent
    mapped = ("trainers", "serve", "kuberay")  # package-dir: their own top-level folders
    if parts[1] not in mapped and not (root / parts[1]).is_dir() and not (
            root / f"{parts[1]}.py").exists():
        # a public name (`from pathways_ray import LocalFleet`): where it is defined
        return _subsystem(getattr(pathways_ray, parts[1]).__module__)
    return "testing" if parts[1] == "testing" else parts[1]


def _imports(path, module: str):
    """Every module an import statement in ``path`` names (at any depth, so lazy
    imports inside functions count too)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the package (a package's __init__ is its own)
                package = module.split(".")[:len(module.split(".")) - node.level
                                             + (path.name == "__init__.py")]
                base = ".".join(package + ([base] if base else []))
            # `from pathways_ray import x` names a module when x is one
            yield from (f"{base}.{a.name}" if base == "pathways_ray" else base
                        for a in node.names)


def test_layers():
    """Each subsystem imports only the ones below it (LAYERS): the chip side never
    imports the client side, nothing in the runtime imports the emulator, serving or
    the trainers, and KubeRay rendering needs only the topology."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folders = {"pathways_ray": "pathways_ray", "trainers": "pathways_ray.trainers",
               "serve": "pathways_ray.serve", "kuberay": "pathways_ray.kuberay"}
    offenders, seen = [], set()
    for folder, package in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            module = ".".join([package, *rel.parts]).removesuffix(".__init__")
            mine = "package" if module == "pathways_ray" else _subsystem(module)
            seen.add(mine)
            assert mine in LAYERS, f"{path}: subsystem {mine!r} is not in LAYERS"
            for name in _imports(path, module):
                theirs = _subsystem(name)
                if theirs is None or theirs == mine or theirs in LAYERS[mine]:
                    continue
                if theirs == "emulation" and str(path.relative_to(root)) in EMULATION_USERS:
                    continue
                offenders.append(f"{path.relative_to(root)} ({mine}) imports {name} ({theirs})")
    assert offenders == []
    assert seen == set(LAYERS), set(LAYERS) - seen


def test_no_runtime_module_is_long_and_no_folder_crowded():
    """Modules of one job: none in the runtime over ~400 lines, no folder over 12 (the
    generated protocol stubs of ``proxy/protos`` aside)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "pathways_ray"
    generated = root / "proxy" / "protos"
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py")
            if generated not in p.parents and (n := len(p.read_text().splitlines())) > 420}
    assert long == {}
    crowded = {str(d.relative_to(root)): n for d in [root, *root.iterdir()] if d.is_dir()
               and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 12}
    assert crowded == {}


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
    code = ("import sys, time\nfrom pathways_ray.cli.main import handle_sigterm_as_interrupt, "
            "Terminated\nhandle_sigterm_as_interrupt()\ntry:\n    import slow_mod\n"
            "    time.sleep(10)\n    print('not interrupted')\nexcept Terminated:\n"
            "    print('terminated after import', sys.modules['slow_mod'].done)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert out.stdout.strip() == "terminated after import True", out.stdout + out.stderr
