"""gateway/api/sse_stream.py: an SSE answer's end goes out in its last write, and a client that
leaves mid-stream closes the events' generator without failing the response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.api.sse_stream import DONE, _SseResponse, with_body_send

SCOPE: dict[str, Any] = {"type": "http", "method": "GET", "path": "/", "headers": []}


def _response(events: AsyncIterator[bytes]) -> _SseResponse:
    return _SseResponse(iterator=events, media_type="text/event-stream", content_length=0)


async def _run(events: AsyncIterator[bytes], receive: Any = None) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError

    await _response(events)(SCOPE, receive or never, send)  # type: ignore[arg-type]
    return sent


def test_the_done_event_and_the_bodys_end_are_one_message() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield b"data: 2\n\n" + DONE

    sent = asyncio.run(_run(events()))
    bodies = [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]
    assert bodies == [(b"data: 1\n\n", True), (b"data: 2\n\n" + DONE, False)]


def test_a_stream_without_done_ends_with_an_empty_message() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield b"event: response.completed\ndata: {}\n\n"

    sent = asyncio.run(_run(events()))
    bodies = [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]
    assert bodies == [(b"event: response.completed\ndata: {}\n\n", True), (b"", False)]


def test_a_client_that_leaves_closes_the_events_and_nothing_more_is_sent() -> None:
    closed = asyncio.Event()
    left = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            left.set()
            await asyncio.Event().wait()  # the next token never comes
            yield b"data: never\n\n"
        finally:
            closed.set()

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def main() -> list[dict[str, Any]]:
        async with asyncio.timeout(5):  # no task of its own: the response runs in this one
            sent = await _run(events(), receive)
        # The handler's task is not left cancelled: it goes on (after_response) as usual.
        task = asyncio.current_task()
        assert task is not None
        assert task.cancelling() == 0
        return sent

    sent = asyncio.run(main())
    assert closed.is_set()
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: 1\n\n"]


def test_a_cancel_from_elsewhere_is_not_taken_for_the_client_leaving() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.Event().wait()
        yield DONE

    async def main() -> None:
        task = asyncio.ensure_future(_run(events()))
        await asyncio.sleep(0.05)
        task.cancel()  # the server stopping
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_the_body_goes_to_the_servers_send_and_the_start_through_the_middleware() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield DONE

    async def main() -> tuple[list[str], list[str]]:
        chain: list[str] = []
        server: list[str] = []

        async def through(message: dict[str, Any]) -> None:
            chain.append(message["type"])

        async def direct(message: dict[str, Any]) -> None:
            server.append(message["type"])

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await _response(events())(scope, receive, through)  # type: ignore[arg-type]

        async def never() -> dict[str, Any]:
            await asyncio.Event().wait()
            raise AssertionError

        await with_body_send(app)(dict(SCOPE), never, direct)  # type: ignore[arg-type]
        return chain, server

    chain, server = asyncio.run(main())
    assert chain == ["http.response.start"]
    assert server == ["http.response.body", "http.response.body"]
