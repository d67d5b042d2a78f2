"""to_the_end: a batch item's final record lands whole even when its batch is cancelled while
it is being written, and the cancellation still reaches the caller afterwards."""

from __future__ import annotations

import asyncio

import pytest

from gateway.batches.item_runner import to_the_end


def test_a_write_under_way_ends_before_the_cancellation_goes_on() -> None:
    async def run() -> None:
        began, may_end = asyncio.Event(), asyncio.Event()
        written: list[str] = []

        async def write() -> str:
            began.set()
            await may_end.wait()
            written.append("completed")
            return "completed"

        caller = asyncio.create_task(to_the_end(write()))
        await began.wait()
        caller.cancel()  # the batch is cancelled while its item is recorded
        caller.cancel()  # twice, as a stopping gateway may
        for _ in range(5):
            await asyncio.sleep(0)
        assert not caller.done()  # still waiting for the write
        may_end.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert written == ["completed"]
        assert await to_the_end(write()) == "completed"  # undisturbed: its result

    asyncio.run(run())
