"""The time of an answer without a client's length limit (gateway/dispatch/answer_time.py): it
runs out only once the answer has begun, stops the reading of the site's stream then (closing
it), and never mistakes the site's own timeout for its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import pytest

from gateway.dispatch.answer_time import AnswerClock
from gateway.sites.interface import SiteChunk


def chunk(*ids: int) -> SiteChunk:
    return SiteChunk(True, ids, "x" * len(ids), None, 3, len(ids))


class Site:
    """A site stream: `first_after_s` before its first token, then a token every `every_s`."""

    def __init__(self, first_after_s: float, every_s: float, tokens: int = 1000) -> None:
        self.first_after_s, self.every_s, self.tokens = first_after_s, every_s, tokens
        self.closed = False

    async def stream(self) -> AsyncGenerator[SiteChunk, None]:
        try:
            yield SiteChunk(True, (), "", None, 3, 0)  # accepted
            await asyncio.sleep(self.first_after_s)
            for i in range(self.tokens):
                yield chunk(i)
                await asyncio.sleep(self.every_s)
        finally:
            self.closed = True


async def read_all(clock: AnswerClock, site: Site) -> list[SiteChunk]:
    stream = site.stream()
    out = [c async for c in clock.read(stream)]
    await stream.aclose()
    return out


def test_a_begun_answer_stops_at_its_time_and_its_stream_closes() -> None:
    site = Site(first_after_s=0.0, every_s=0.01)
    clock = AnswerClock(time.monotonic() + 0.2)
    chunks = asyncio.run(read_all(clock, site))
    assert clock.ran_out
    assert site.closed
    assert 0 < sum(len(c.token_ids) for c in chunks) < site.tokens


def test_an_answer_that_has_not_begun_waits_past_its_time() -> None:
    # Queued past the answer's time: it is not cut before its first token (the request's own
    # deadline bounds the wait), and it ends with the tokens it then got.
    site = Site(first_after_s=0.3, every_s=0.01)
    clock = AnswerClock(time.monotonic() + 0.05)
    chunks = asyncio.run(read_all(clock, site))
    assert clock.ran_out
    assert [c.token_ids for c in chunks if c.token_ids] == [(0,)]


def test_a_stream_that_ends_first_is_read_whole() -> None:
    site = Site(first_after_s=0.0, every_s=0.0, tokens=5)
    clock = AnswerClock(time.monotonic() + 60)
    chunks = asyncio.run(read_all(clock, site))
    assert not clock.ran_out
    assert sum(len(c.token_ids) for c in chunks) == 5


def test_the_sites_own_timeout_is_not_the_clocks() -> None:
    async def failing() -> AsyncGenerator[SiteChunk, None]:
        yield chunk(1)
        raise TimeoutError("the site's")

    async def run() -> None:
        clock = AnswerClock(time.monotonic() + 60)
        async for _ in clock.read(failing()):
            pass

    with pytest.raises(TimeoutError, match="the site's"):
        asyncio.run(run())


def test_time_that_runs_out_between_reads_ends_the_answer_before_the_next() -> None:
    async def run() -> tuple[AnswerClock, int]:
        site = Site(first_after_s=0.0, every_s=0.0)
        clock = AnswerClock(time.monotonic() + 0.05)
        read = 0
        async for c in clock.read(site.stream()):
            read += len(c.token_ids)
            if read:
                await asyncio.sleep(0.1)  # the caller is busy (writing to its client)
        return clock, read

    clock, read = asyncio.run(run())
    assert clock.ran_out
    assert read == 1


def test_a_caller_that_goes_away_is_not_taken_for_the_answers_time() -> None:
    async def run() -> None:
        site = Site(first_after_s=0.0, every_s=0.01)
        clock = AnswerClock(time.monotonic() + 60)

        async def consume() -> None:
            async for _ in clock.read(site.stream()):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not clock.ran_out

    asyncio.run(run())
