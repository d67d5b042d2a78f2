"""gateway/api/client_gone.py: a plain answer is cancelled when its client's connection says it
has gone, answers 499 then, and is left alone otherwise (its result, or another's cancel)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.api.client_gone import CLIENT_CLOSED, unless_client_leaves
from gateway.api.openai_errors import OpenAIError


class Connection:
    """An ASGI receive() after the body was read: nothing until the client goes."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, object]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_the_answer_is_cancelled_when_its_client_goes() -> None:
    async def run() -> None:
        connection = Connection()
        cancelled = asyncio.Event()

        async def answer() -> str:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return "never"

        asyncio.get_running_loop().call_later(0.01, connection.gone.set)
        with pytest.raises(OpenAIError) as refused:
            await unless_client_leaves(connection.receive, answer())  # type: ignore[arg-type]
        assert refused.value.status == CLIENT_CLOSED
        assert cancelled.is_set()
        task = asyncio.current_task()
        assert task is not None
        assert task.cancelling() == 0  # the handler's task goes on, not cancelled

    asyncio.run(run())


def test_an_answer_ready_first_is_returned_and_the_watch_ends() -> None:
    async def run() -> None:
        connection = Connection()
        before = len(asyncio.all_tasks())
        assert await unless_client_leaves(connection.receive, asyncio.sleep(0, "done")) == "done"  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == before

    asyncio.run(run())


def test_another_cancel_stays_a_cancel() -> None:
    """The server stopping cancels the handler: that is not the client's leaving."""

    async def run() -> None:
        connection = Connection()

        async def handler() -> None:
            await unless_client_leaves(connection.receive, asyncio.sleep(60))  # type: ignore[arg-type]

        task = asyncio.create_task(handler())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
