"""Keepalives on a replica's response stream, so that the ingress learns in about a
second that a replica died under a request, not when Ray declares its node dead
(its health checks: ~5 s on the emulated fleet, 15-30 s with Ray's defaults).
Pure asyncio; no Ray.

The replica wraps each response in :func:`with_keepalive`: a ``KEEPALIVE`` marker
at once, and another whenever ``interval_s`` passes without one, until the
response's first item; then the items as they come. The ingress reads it through
:func:`until_silent`, which drops the markers and, once it has seen one (so a
replica without keepalives is waited on as before), raises :class:`Silent` if
``silence_s`` passes with nothing at all before the first real item. After that
item, a stream is read as it comes: tokens already reached the user, and a silent
stream is ended by Ray's own detection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

__all__ = ["KEEPALIVE", "Silent", "until_silent", "with_keepalive"]

KEEPALIVE = "\x00pathways-ray:keepalive"


class Silent(Exception):
    """The replica's keepalives stopped before its response began."""


def _is_keepalive(item) -> bool:
    return isinstance(item, str) and item == KEEPALIVE


async def with_keepalive(stream: AsyncIterator, interval_s: float) -> AsyncIterator:
    it = stream.__aiter__()
    yield KEEPALIVE
    pending = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            break
        # The response began: the ingress reads the rest as it comes (no marker is
        # looked at any more), so the items pass straight through, without the task
        # and timed wait per item (~14 us each).
        async for item in it:
            yield item
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.wait({pending})  # it is running until the cancel lands
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


async def until_silent(stream: AsyncIterator, silence_s: float) -> AsyncIterator:
    it = stream.__aiter__()
    heard = False
    while True:
        try:
            item = await (asyncio.wait_for(it.__anext__(), silence_s) if heard
                          else it.__anext__())
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise Silent(f"the replica sent nothing for {silence_s:g} s, not even a "
                         f"keepalive") from None
        if _is_keepalive(item):
            heard = True
            continue
        yield item
        break
    async for item in it:
        if not _is_keepalive(item):
            yield item
