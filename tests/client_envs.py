"""Client environments of their own, as real users keep them: a JAX program's virtual
environment apart from the cluster's (a notebook's, MaxText's), of another JAX or
another Python. Each is made on first use under ``.venv-clients/<name>`` and reused
while its requirements and Python stay the same (a stamp file says which).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / ".venv-clients"


@dataclass(frozen=True)
class ClientEnv:
    python: str  # "3.11", "3.12"
    requirements: tuple[str, ...]
    no_deps: tuple[str, ...] = ()  # installed after, without their declared needs


ENVS = {
    # The oldest JAX pathways-ray serves (a TPU VM image of 2026-10 still holds it).
    "jax-0.10.2": ClientEnv("3.11", ("jax==0.10.2", "jaxlib==0.10.2", "pathwaysutils==0.1.13")),
    # MaxText 0.2.5 from PyPI and what its pre-training trainer imports (its wheel
    # declares every dependency under extras such as [tpu], which would bring
    # TensorFlow and Google Cloud clients; a CPU client needs none of them).
    "maxtext": ClientEnv("3.12", (
        "jax==0.12.1", "jaxlib==0.12.1", "pathwaysutils==0.1.13", "flax==0.12.12",
        "optax==0.2.8", "orbax-checkpoint==0.12.8", "absl-py==2.5.1", "omegaconf==2.4.0",
        "pydantic==2.14.4", "ml-collections", "jaxtyping==0.3.11", "tensorboardX==2.6.5",
        "Jinja2==3.1.6", "aqtp==0.9.0", "qwix==0.1.8", "tokamax==0.0.17",
        "huggingface_hub==2.4.0", "transformers==5.25.0", "grain==0.2.18", "drjax==0.2.1",
        "pillow==13.0.0", "tiktoken==0.14.0", "sentencepiece==0.2.3", "sympy==1.14.0"),
        no_deps=("maxtext==0.2.5",)),
}


def find_python(version: str) -> str:
    """An interpreter of ``version``: on PATH, else under pyenv (whose shims fail for a
    version that is not selected)."""
    candidates = [f"python{version}"] + sorted(
        str(p) for p in (Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
                         / "versions").glob(f"{version}.*/bin/python3"))
    for exe in candidates:
        try:
            out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return exe
    raise RuntimeError(f"no Python {version} on this machine (looked for {candidates}); "
                       f"install it (pyenv install {version}) to make this client env")


def client_python(name: str, timeout_s: float = 1200) -> Path:
    """The interpreter of client environment ``name``, made first if needed."""
    env = ENVS[name]
    where = HOME / name
    stamp = hashlib.sha256(repr(env).encode()).hexdigest()
    HOME.mkdir(exist_ok=True)
    with open(HOME / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one maker at a time
        python, made = where / "bin" / "python", where / ".stamp"
        if python.exists() and made.exists() and made.read_text() == stamp:
            return python
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run([find_python(env.python), "-m", "venv", str(where)], check=True,
                       timeout=300)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        quiet = {**os.environ, "PYTHONWARNINGS": "ignore"}
        subprocess.run(pip + list(env.requirements), check=True, timeout=timeout_s, env=quiet,
                       stdout=subprocess.DEVNULL)
        if env.no_deps:
            subprocess.run(pip + ["--no-deps", *env.no_deps], check=True, timeout=timeout_s,
                           env=quiet, stdout=subprocess.DEVNULL)
        made.write_text(stamp)
        return python


def published_file(requirement: str, path: str) -> Path:
    """A file of a package's source distribution as published on the package index
    (``flax==0.12.8``, ``examples/...``), downloaded once with pip and kept under
    ``.venv-clients/sdists``; never copied into this repository."""
    name, _, version = requirement.partition("==")
    where = HOME / "sdists" / f"{name}-{version}"
    target = where / path
    if target.exists():
        return target
    import tarfile
    import tempfile

    HOME.mkdir(exist_ok=True)
    with open(HOME / ".sdists.lock", "w") as lock, tempfile.TemporaryDirectory() as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", "--disable-pip-version-check", "-d", tmp,
                        requirement], check=True, timeout=600, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
        (archive,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(archive) as tar:  # its top folder is <name>-<version>
            tar.extractall(where.parent, filter="data")
    if not target.exists():
        raise FileNotFoundError(f"{requirement}'s source distribution has no {path}")
    return target
