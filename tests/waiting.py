"""Waiting in tests for something real to happen, with a deadline that the failure names."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_until(cond: Callable, timeout_s: float, what: str, *, every_s: float = 0.5,
               detail: Callable[[], str] | None = None):
    """``cond()``'s first truthy value, polled every ``every_s``; fails the test with
    ``what`` (and ``detail()``) if none comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"{what} within {timeout_s:g} s" + (f"; {detail()}" if detail else ""))
