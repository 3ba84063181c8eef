"""Ray token authentication for the clusters we start and join.

Ray 2.60 turns token auth on by default; every ``ray start`` and every driver
of one cluster must agree on ``RAY_AUTH_MODE=token`` and the token. A fleet
keeps its token in a 0600 file and points every process at it with
``RAY_AUTH_TOKEN_PATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTH_MODE = "RAY_AUTH_MODE"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
TOKEN = "RAY_AUTH_TOKEN"


def write_token(path: Path) -> Path:
    """Create a fresh random token readable only by this user."""
    from ray._private.authentication.authentication_token_generator import (
        generate_new_authentication_token,
    )

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(generate_new_authentication_token())
    return path


def auth_env(token_path: Path) -> dict[str, str]:
    """Env vars that make a process use this token (and no other)."""
    return {AUTH_MODE: "token", TOKEN_PATH: str(token_path)}


def use_token(token_path: Path) -> dict[str, str | None]:
    """Make this process authenticate with ``token_path`` until ``restore``; returns
    the settings it replaced (for ``restore``).

    Ray reads its auth mode once, when it is imported, and caches the token, so
    both are refreshed here (the same steps Ray takes when it enables auth).
    """
    previous = {k: os.environ.get(k) for k in (AUTH_MODE, TOKEN_PATH, TOKEN)}
    os.environ.pop(TOKEN, None)  # would take precedence over the path
    os.environ.update(auth_env(token_path))
    _reload()
    return previous


def restore(previous: dict[str, str | None], token_path: Path) -> None:
    """Put back what ``use_token(token_path)`` replaced, unless something has pointed
    this process at another token since (a fleet started after it)."""
    if os.environ.get(TOKEN_PATH) != str(token_path):
        return
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _reload()


def _reload() -> None:
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
