"""Keepalives on a replica's response stream and the ingress's silence watch (pure
asyncio, milliseconds): how a replica lost under a request is told from a slow one."""

from __future__ import annotations

import asyncio

import pytest

from pathways_ray.serve.keepalive import KEEPALIVE, Silent, until_silent, with_keepalive


async def _slow(items, delay_s, then_hang=False):
    for item in items:
        await asyncio.sleep(delay_s)
        yield item
    if then_hang:
        await asyncio.Event().wait()  # a replica that died: nothing more, ever


async def _collect(agen):
    return [x async for x in agen]


def test_a_slow_replica_keeps_the_stream_alive_and_its_items_pass_unchanged():
    """A response that takes 5 keepalive intervals arrives whole, markers dropped; the
    replica side sends a marker at once and then one per quiet interval until the
    first item, and none after it (the ingress reads the rest as it comes)."""
    raw = asyncio.run(_collect(with_keepalive(_slow(["a", "b"], 0.05), 0.02)))
    assert raw[0] == KEEPALIVE and raw.count(KEEPALIVE) >= 2
    assert raw[raw.index("a"):] == ["a", "b"]
    got = asyncio.run(_collect(until_silent(with_keepalive(_slow(["a", "b"], 0.05), 0.02),
                                            silence_s=0.04)))
    assert got == ["a", "b"]


def test_a_lost_replica_is_silent_within_the_silence_window():
    """The keepalives stop (the replica died): Silent after silence_s, not a hang."""
    async def lost():
        yield KEEPALIVE
        await asyncio.Event().wait()

    async def run():
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(Silent, match="sent nothing for 0.05 s"):
            await _collect(until_silent(lost(), silence_s=0.05))
        return asyncio.get_running_loop().time() - t0

    assert asyncio.run(run()) < 1.0


def test_a_replica_without_keepalives_is_waited_on_as_before():
    """No marker seen: no silence deadline (a replica of Ray Serve LLM's own class)."""
    got = asyncio.run(_collect(until_silent(_slow(["x"], 0.1), silence_s=0.02)))
    assert got == ["x"]


def test_after_the_first_item_a_stream_is_read_as_it_comes():
    """Tokens already reached the user: a pause mid-stream is not a loss to resend."""
    async def stream():
        yield KEEPALIVE
        yield "first"
        await asyncio.sleep(0.1)
        yield "second"

    assert asyncio.run(_collect(until_silent(stream(), silence_s=0.02))) == ["first", "second"]


def test_closing_the_keepalive_stream_closes_the_response_under_it():
    """A client that goes away cancels the engine's request (the generator is closed)."""
    closed = asyncio.Event()

    async def engine():
        try:
            yield "a"
            await asyncio.Event().wait()
        finally:
            closed.set()

    async def run():
        agen = with_keepalive(engine(), 0.01)
        assert [await agen.__anext__() for _ in range(2)] == [KEEPALIVE, "a"]
        waiting = asyncio.ensure_future(agen.__anext__())  # the engine waits
        await asyncio.sleep(0.05)
        assert not waiting.done(), "a keepalive after the response began"
        waiting.cancel()  # the client went away mid-stream
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await agen.aclose()
        return closed.is_set()

    assert asyncio.run(run())
