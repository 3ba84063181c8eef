"""Names, directories, environment variables and timeouts: defined here and nowhere else.

Pure (no Ray). Every wait on Ray or on a chip worker takes its deadline from
``TIMEOUTS``; each entry names the environment variable that overrides it, so an
error that says a wait ran out can name the setting that would make it longer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "DIR_ENV",
    "NAMESPACE",
    "PLATFORM_ENV",
    "STORAGE_ENV",
    "TIMEOUTS",
    "TRANSFER_ENV",
    "Timeout",
    "USER_ENV",
    "base_dir",
    "default_compilation_cache_dir",
    "settings_env",
    "storage_roots",
    "timeout_s",
    "transfer_mode",
]

def settings_env(environ=None) -> dict[str, str]:
    """What a process pathways-ray starts (controller, chips, sidecars) must see of its
    starter's environment: every ``PATHWAYS_RAY_*`` setting, and Ray's unhandled-error
    reports off (a lost slice's refs are handled, not leaked). Passed as an argument,
    not a ``runtime_env``: with one, Ray starts each actor through an extra Python
    process (setup_worker.py) instead of an idle worker (~2 s of every connect here)."""
    environ = os.environ if environ is None else environ
    return {"RAY_IGNORE_UNHANDLED_ERRORS": "1",
            **{k: v for k, v in environ.items() if k.startswith("PATHWAYS_RAY_")}}


# The Ray namespace of every named actor and KV entry pathways-ray creates.
NAMESPACE = "pathways-ray"

DIR_ENV = "PATHWAYS_RAY_DIR"
CACHE_ENV = "PATHWAYS_RAY_COMPILATION_CACHE_DIR"
PLATFORM_ENV = "PATHWAYS_RAY_PLATFORM"  # "cpu" or "tpu": overrides detection on a host
USER_ENV = "PATHWAYS_RAY_USER"  # who a shared service's status shows (default: the login)
# How a cross-slice reshard moves shards: "pull" (JAX's transfer server, chip to chip)
# or "objects" (Ray objects through the hosts' stores).
TRANSFER_ENV = "PATHWAYS_RAY_TRANSFER"
TRANSFER_MODES = ("pull", "objects")
# Where a proxy's clients may have the chips write and read (persistence, profiles): a
# comma-separated list of directories and URL prefixes; by default any bucket (the
# hosts' own credentials decide), no local path.
STORAGE_ENV = "PATHWAYS_RAY_PROXY_STORAGE"


def transfer_mode() -> str:
    """``$PATHWAYS_RAY_TRANSFER``: ``pull`` (default) or ``objects``."""
    mode = os.environ.get(TRANSFER_ENV, "pull")
    if mode not in TRANSFER_MODES:
        raise ValueError(f"{TRANSFER_ENV}={mode!r} is not a transfer mode; use one of "
                         f"{', '.join(TRANSFER_MODES)}")
    return mode


def storage_roots() -> tuple[str, ...]:
    """``$PATHWAYS_RAY_PROXY_STORAGE`` as a tuple (default: ``("gs://",)``)."""
    value = os.environ.get(STORAGE_ENV, "gs://")
    return tuple(r.strip() for r in value.split(",") if r.strip())


def base_dir() -> Path:
    """Where local state lives: ``$PATHWAYS_RAY_DIR`` or ``/tmp/pathways-ray``.

    Kept short because Ray's Unix socket paths of local fleets live below it.
    """
    return Path(os.environ.get(DIR_ENV, "/tmp/pathways-ray"))


def default_compilation_cache_dir() -> str:
    """``$PATHWAYS_RAY_COMPILATION_CACHE_DIR``, else ``<PATHWAYS_RAY_DIR>/xla-cache``.

    On an emulated fleet every host is this machine, so a local directory is seen by
    all of them; on a real cluster point the variable at shared storage (gs://…, NFS).
    """
    return os.environ.get(CACHE_ENV) or str(base_dir() / "xla-cache")


@dataclass(frozen=True)
class Timeout:
    """One named deadline: its default and the variable that overrides it."""

    name: str
    default_s: float
    what: str

    @property
    def env(self) -> str:
        return f"PATHWAYS_RAY_{self.name.upper()}_TIMEOUT_S"

    def seconds(self) -> float:
        raw = os.environ.get(self.env)
        if raw is None:
            return self.default_s
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{self.env}={raw!r} must be a number of seconds") from None
        if value <= 0:
            raise ValueError(f"{self.env}={raw!r} must be positive")
        return value


TIMEOUTS: dict[str, Timeout] = {t.name: t for t in [
    Timeout("reserve", 120.0, "reserving a slice's placement group"),
    Timeout("worker_start", 180.0, "starting chip workers and joining their JAX world"),
    Timeout("control", 60.0, "a control call to the controller or a chip worker"),
    Timeout("stream", 600.0, "a chip worker making progress on its command stream"),
    Timeout("step", 10.0, "a chip worker with work outstanding silent (no ack, no "
                          "heartbeat) before its host counts as frozen"),
    Timeout("compile", 300.0, "a chip worker alive but making no progress (compiling, or "
                              "a step that hangs) before it counts as hung"),
    Timeout("fetch", 300.0, "a result (fetch, block_until_ready, a cross-slice reshard)"),
    Timeout("shutdown", 30.0, "releasing a slice or closing a client"),
    Timeout("lease", 600.0, "waiting in a shared service's queue for a lease"),
    Timeout("heartbeat", 30.0, "a leased client (or one waiting in the queue) silent before "
                               "the service ends its lease and takes its slices back"),
]}


def timeout_s(name: str) -> float:
    """The deadline named ``name`` (see ``TIMEOUTS``), after its env override."""
    return TIMEOUTS[name].seconds()
