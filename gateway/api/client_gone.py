"""A non-streaming answer is cancelled when its client goes away.

A stream notices its client leave (litestar stops its iterator, dispatch records the request as
cancelled and its site stops generating). A plain request did not: uvicorn does not cancel a
handler whose connection closed, so the answer ran to its end at its site (issue 48: a client
that left after 3 s had 2,000 tokens generated for ~6 minutes, billed in full, its key's
concurrency slot held meanwhile), and an `n: 8` request ran to the request timeout.

While a plain answer is collected, one task waits on the connection's `receive()`: once the body
has been read, uvicorn answers it only with `http.disconnect`, when the client closes the
connection (or the answer has been sent). Then the handler's task is cancelled: dispatch sees the
cancellation where it waits on its site, closes the site call (the site cancels the request),
records it `cancelled` ("client went away") with the tokens generated so far, settles the key
with them and gives both slots back (gateway/dispatch/stream.py). The handler answers 499 (as
nginx names it), which nobody reads but the HTTP metrics count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from litestar.types import Receive

from gateway.api.openai_errors import OpenAIError

T = TypeVar("T")
CLIENT_CLOSED = 499


def client_closed() -> OpenAIError:
    return OpenAIError(
        CLIENT_CLOSED,
        "the client closed the connection before its answer was ready; the request was cancelled",
        code="client_closed_request",
    )


async def unless_client_leaves(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result, or 499 (client_closed) once the client has gone, `work` cancelled."""
    task = asyncio.current_task()
    assert task is not None  # a handler runs in a task
    left = False

    async def cancel_when_gone() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass  # a body's trailing empty message; the body itself was read before
        left = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(cancel_when_gone())
    try:
        return await work
    except asyncio.CancelledError:
        # The watcher's cancel, and no other (the server stopping) besides it: the client left.
        if left and task.uncancel() == 0:
            raise client_closed() from None
        raise
    finally:
        watcher.cancel()
