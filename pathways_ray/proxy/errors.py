"""The statuses a proxy client sees, each chosen on purpose. Pure.

A request that cannot be served raises one of the ``ProxyStatus`` errors below
(its status code is the one IFRT's statuses carry, ``tensorflow.error.Code``). The
platform's own failures keep their meaning: a lost slice is ``DATA_LOSS`` (the word
pathwaysutils.elastic looks for), the user's program failing on the chips is its
own message (never the chip's Python traceback), a deadline is
``DEADLINE_EXCEEDED``. Anything else is a bug of the server: the client gets
``INTERNAL`` with an incident id, and the server's log has the traceback under
that id. No exception type is guessed at from its name or its text.
"""

from __future__ import annotations

import logging
import secrets

from pathways_ray.errors import PathwaysError, RemoteError, SliceLost

__all__ = ["DATA_LOSS", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "INTERNAL",
           "INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED",
           "UNAVAILABLE", "UNIMPLEMENTED", "FailedPrecondition", "InvalidArgument", "NotFound",
           "PermissionDenied", "ProxyStatus", "Status", "Unauthenticated", "Unavailable",
           "Unimplemented", "remote_message", "status_of"]

logger = logging.getLogger("pathways_ray.proxy")

# tensorflow.error.Code
(INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, PERMISSION_DENIED, FAILED_PRECONDITION,
 UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS, UNAUTHENTICATED) = (
    3, 4, 5, 7, 9, 12, 13, 14, 15, 16)


class ProxyStatus(Exception):
    """A request the proxy refuses, with the status code the client gets."""

    code = INTERNAL


class InvalidArgument(ProxyStatus):
    """The request names something impossible: a shape, a stride, a device, a sharding."""

    code = INVALID_ARGUMENT


class NotFound(ProxyStatus):
    """A handle that is not (or no longer) the session's."""

    code = NOT_FOUND


class PermissionDenied(ProxyStatus):
    """Something this server does not let its clients do (a location outside its
    storage roots)."""

    code = PERMISSION_DENIED


class FailedPrecondition(ProxyStatus):
    """A request out of order (before ``InitRequest``, on a closed session)."""

    code = FAILED_PRECONDITION


class Unimplemented(ProxyStatus):
    """Something the protocol carries that pathways-ray does not serve (yet)."""

    code = UNIMPLEMENTED


class Unavailable(ProxyStatus):
    """The platform cannot serve the session now (no slices to be had, say)."""

    code = UNAVAILABLE


class Unauthenticated(ProxyStatus):
    """A session without this server's token."""

    code = UNAUTHENTICATED


class Status(ProxyStatus):
    """A status decided once (``status_of``), kept where a failed request's results
    would have been, and raised as it is when they are used."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def remote_message(e: RemoteError) -> str:
    """The user's error as the chips met it, without the chip worker's traceback: the
    command and the last exception's own lines (XLA's message, for a compile error)."""
    lines = e.remote_traceback.rstrip().splitlines()
    start = 0
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            start = i + 1
    while start < len(lines) and (lines[start].startswith((" ", "\t")) or not lines[start]):
        start += 1
    where = "" if e.command.startswith("sidecar ") else " on the chips"  # (names its host)
    return f"{e.command} failed{where}: " + "\n".join(lines[start:]).strip()


def status_of(e: BaseException, where: str = "") -> tuple[int, str]:
    """``(code, message)`` a client sees for ``e``; an unexpected ``e`` is logged with its
    traceback under a new incident id, which the client's message names."""
    if isinstance(e, ProxyStatus):
        return e.code, str(e)
    if isinstance(e, SliceLost):
        return DATA_LOSS, str(e)  # the client names the code: "DATA_LOSS: slice ..."
    if isinstance(e, RemoteError):
        return INTERNAL, remote_message(e)
    if isinstance(e, TimeoutError):  # a WaitTimeout names the setting that bounds it
        return DEADLINE_EXCEEDED, str(e)
    if isinstance(e, PathwaysError):
        return UNAVAILABLE, str(e)
    incident = secrets.token_hex(4)
    logger.error("internal error %s%s", incident, f" in {where}" if where else "",
                 exc_info=(type(e), e, e.__traceback__))
    return INTERNAL, (f"internal error {incident} in the pathways-ray proxy"
                      f"{f' ({where})' if where else ''}; the server's log has its details "
                      f"under that id")
