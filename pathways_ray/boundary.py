"""The one place where Ray's failures become ours.

Every wait on Ray in the client, the controller and the chip workers goes
through ``get`` or ``wait`` here, with a deadline named in ``config.TIMEOUTS``
(or one the caller was given). What comes out is one of:

- ``WaitTimeout`` naming what was awaited and the setting that bounds it;
- the ``PathwaysError``, ``RemoteError``, ``ValueError`` or ``TypeError`` that the
  remote side raised itself (unwrapped from Ray's ``RayTaskError``, as it was);
- what ``died(exc)`` makes of a dead process, host or lost object: the caller
  knows whether that was the controller (``ControllerDied``), a chip worker of a
  slice (``SliceLost``) or a lone worker (``WorkerDied``, the default). That holds
  when a live peer's error reached Ray first: a collective fails on every rank
  once one rank's process is gone, and the death is the cause to report.

Nothing else of ``ray.exceptions`` escapes these calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pathways_ray.config import TIMEOUTS
from pathways_ray.errors import PathwaysError, RemoteError, WaitTimeout, WorkerDied

__all__ = ["deadline", "death_summary", "failed_now", "get", "health", "is_death", "settle",
           "translate", "wait"]

Died = Callable[[BaseException], PathwaysError]

# What a remote side raised itself and the caller gets as it was.
_OURS = (PathwaysError, RemoteError, ValueError, TypeError)

ECHO_GRACE_S = 10.0
"""How long ``get`` waits for the other calls of a failed group to show a dead process
before it reports the error it has as the cause."""


def deadline(timeout: str | float) -> tuple[float, str]:
    """``(seconds, the setting that names them)`` for a ``config.TIMEOUTS`` name or a
    number of seconds the caller passed in as ``timeout_s``."""
    if isinstance(timeout, str):
        t = TIMEOUTS[timeout]
        return t.seconds(), f"${t.env}"
    return float(timeout), "timeout_s"


def _lone_worker(e: BaseException) -> PathwaysError:
    return WorkerDied(f"a Ray worker process died: {e}")


def is_death(e: BaseException) -> bool:
    """A process, its host or an object it held is gone (as opposed to an error
    raised by code that ran)."""
    import ray.exceptions as rex

    return isinstance(e, (rex.RayActorError, rex.ObjectLostError, rex.NodeDiedError,
                          rex.WorkerCrashedError, rex.OwnerDiedError,
                          rex.ObjectFetchTimedOutError))


def death_summary(e: BaseException) -> str:
    """One line for a dead process, without Ray's multi-line report."""
    text = str(e)
    if "node has died" in text or "node was terminated" in text:
        return f"a chip worker's host died ({type(e).__name__})"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"a process died ({type(e).__name__}: {first[:200]})"


def translate(e: BaseException, what: str, died: Died | None) -> BaseException:
    """Our exception for Ray's ``e``, raised while waiting for ``what``."""
    import ray.exceptions as rex

    if isinstance(e, rex.RayTaskError) and not isinstance(e, rex.RayActorError):
        cause = e.cause
        if isinstance(cause, _OURS):
            return cause  # ours, or misuse the remote side found: as it was raised
        if cause is not None and is_death(cause):
            return (died or _lone_worker)(cause)
        return PathwaysError(f"{what} raised {type(cause).__name__} (a bug in pathways-ray; "
                             f"please report it):\n{e}")
    if is_death(e):
        return (died or _lone_worker)(e)
    if isinstance(e, rex.RayError):
        return PathwaysError(f"{what} failed in Ray: {type(e).__name__}: {e}")
    return e


def get(refs: Any, *, timeout: str | float, what: str, died: Died | None = None) -> Any:
    """``ray.get(refs)`` within ``timeout``; Ray's errors become ours (see module doc)."""
    import ray

    seconds, setting = deadline(timeout)
    start = time.monotonic()
    try:
        return ray.get(refs, timeout=seconds)
    except ray.exceptions.GetTimeoutError:
        raise WaitTimeout(f"{what} did not finish within {seconds:g} s; a slower machine "
                          f"may need a longer {setting}") from None
    except ray.exceptions.RayError as e:
        if died is not None and isinstance(refs, list) and len(refs) > 1 and _foreign(e):
            # A collective fails on the live ranks too when one rank's process dies
            # ("connection closed by peer"), and Ray raises whichever error it saw first.
            # The death is the cause; look for it among the others before blaming code.
            grace = min(ECHO_GRACE_S, max(0.0, seconds - (time.monotonic() - start)))
            death = _death_among(refs, grace)
            if death is not None:
                raise translate(death, what, died) from None
        raise translate(e, what, died) from None


def _foreign(e: BaseException) -> bool:
    """An error raised by code on the remote side that is neither ours nor a death:
    what ``translate`` would call a bug."""
    import ray.exceptions as rex

    return (isinstance(e, rex.RayTaskError) and not isinstance(e, rex.RayActorError)
            and not isinstance(e.cause, _OURS) and not _death_in(e))


def _death_in(e: BaseException) -> bool:
    """A death, or a task error caused by one."""
    return is_death(e) or is_death(getattr(e, "cause", None))


def _death_among(refs: Sequence, seconds: float) -> BaseException | None:
    """The first of ``refs`` to fail with a death (``is_death``, also as a task's cause)
    within ``seconds``, or None; returns as soon as one does."""
    import ray

    end = time.monotonic() + seconds
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, fetch_local=False,
                                  timeout=max(0.0, end - time.monotonic()))
        if not ready:
            return None
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError as e:
                if _death_in(e):
                    return e
            except Exception:  # noqa: BLE001 - a result that cannot be read: not a death
                pass
    return None


def wait(refs: Sequence, *, timeout: str | float, what: str, fetch_local: bool = True) -> None:
    """Wait until every ref is ready (failed ones count as ready), within ``timeout``."""
    import ray

    seconds, setting = deadline(timeout)
    refs = list(refs)
    if not refs:
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=seconds, fetch_local=fetch_local)
    if len(ready) < len(refs):
        raise WaitTimeout(f"{what}: {len(refs) - len(ready)} of {len(refs)} did not finish "
                          f"within {seconds:g} s; a slower machine may need a longer "
                          f"{setting}")


def settle(refs: Sequence, timeout: str | float) -> int:
    """Best effort for shutdown paths: wait up to ``timeout`` for ``refs`` and ignore
    their errors. Returns how many did not finish in time."""
    import ray

    refs = list(refs)
    if not refs:
        return 0
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline(timeout)[0])
    return len(refs) - len(ready)


def failed_now(refs: Sequence) -> tuple[list, list[tuple[Any, BaseException]]]:
    """Split refs that already finished from those still running, without blocking:
    ``(still running, [(ref, Ray's exception)] of those that finished with one)``."""
    import ray

    refs = list(refs)
    if not refs:
        return [], []
    ready, running = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    failed = []
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError as e:
            failed.append((ref, e))
    return running, failed


def health(pairs: Sequence[tuple[Any, Any]], timeout_s: float) -> list[tuple[Any, str]]:
    """Ping ``(item, actor handle)`` pairs: each item with ``"ok"``, ``"dead"`` or
    ``"unresponsive"`` (no answer within ``timeout_s``: frozen, or its host is going)."""
    import ray

    refs = [h.ping.remote() for _, h in pairs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ready_set = set(ready)
    out = []
    for (item, _), ref in zip(pairs, refs, strict=True):
        if ref not in ready_set:
            out.append((item, "unresponsive"))
            continue
        try:
            ray.get(ref, timeout=0)
            out.append((item, "ok"))
        except ray.exceptions.RayError:
            out.append((item, "dead"))
    return out
