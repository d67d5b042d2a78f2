"""The SSE answer's ASGI response: litestar's Stream, less two costs a stream paid per request.

- **Its end in the last write.** litestar sends a stream's end as an empty body message of its
  own after the iterator stops: one more socket write (a system call, the largest single cost
  of a chunk) per answer. An OpenAI stream's last event is `data: [DONE]`, so that event goes
  out as the body's last message, with the chunked encoding's end in the same write.
- **No task group per answer.** litestar runs the iterator in an anyio task group beside a
  task that waits for the client to leave; the group, its cancel scope and its second task cost
  about as much as the answer's own chunks at a thousand streams. Here one watcher task waits on
  `receive()` and, when the client leaves, cancels the handler's task where it waits for its
  next chunk (as gateway/api/client_gone.py does for plain answers): the iterator is closed
  there, which cancels the request at its site and records it (gateway/dispatch/stream.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterable
from typing import TYPE_CHECKING, Any, cast

from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse
from litestar.utils.helpers import get_enum_string_value

if TYPE_CHECKING:
    from collections.abc import Iterable

    from litestar.background_tasks import BackgroundTask, BackgroundTasks
    from litestar.connection import Request
    from litestar.datastructures.cookie import Cookie
    from litestar.enums import MediaType
    from litestar.response.base import ASGIResponse
    from litestar.types import ASGIApp, Receive, Scope, Send, TypeEncodersMap

# The last event of an OpenAI stream (completions and chat; the Responses API ends otherwise).
DONE = b"data: [DONE]\n\n"
# Where with_body_send leaves the server's own send in the scope.
BODY_SEND = "fedllm.body_send"


def with_body_send(app: ASGIApp) -> ASGIApp:
    """`app` with the server's send in each scope, for _SseResponse's body messages. Each chunk
    went through three wrappers of send (litestar's exception handler twice, the HTTP metrics)
    that read only the response's start: at a thousand streams, ~2 % of the gateway's core."""

    async def app_with_body_send(scope: Scope, receive: Receive, send: Send) -> None:
        scope[BODY_SEND] = send  # type: ignore[literal-required]
        await app(scope, receive, send)

    return app_with_body_send


class SseStream(Stream):
    """A litestar Stream whose ASGI response is _SseResponse."""

    def to_asgi_response(  # litestar's signature
        self,
        app: Any,
        request: Request[Any, Any, Any],
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: MediaType | str | None = None,
        status_code: int | None = None,
        type_encoders: TypeEncodersMap | None = None,
    ) -> ASGIResponse:
        # litestar's Stream.to_asgi_response, building this module's response.
        assert isinstance(self.iterator, AsyncIterable)  # the answers' event generators
        return _SseResponse(
            background=self.background or background,
            content_length=0,
            cookies=self.cookies if cookies is None else itertools.chain(self.cookies, cookies),
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers={**headers, **self.headers} if headers is not None else self.headers,
            is_head_response=is_head_response,
            iterator=self.iterator,
            media_type=get_enum_string_value(media_type or self.media_type or "text/plain"),
            status_code=self.status_code or status_code,
        )


class _SseResponse(ASGIStreamingResponse):
    __slots__ = ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The start goes through the middleware (the metrics read its status, the exception
        # handler that it started); the body, where the server gave its own send, straight to it.
        await self.start_response(send=send)
        if self.is_head_response:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            body_send = cast("Send", scope.get(BODY_SEND, send))
            await self.send_body(send=body_send, receive=receive)
        await self.after_response()

    async def send_body(self, send: Send, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None  # a handler runs in a task
        state = {"streaming": True, "left": False}

        def gone(watcher: asyncio.Task[None]) -> None:
            # Only while the chunks are sent: after that a cancel would hit what follows.
            if state["streaming"] and not watcher.cancelled():
                state["left"] = True
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(_disconnect(receive))
        watcher.add_done_callback(gone)
        try:
            await self._send_events(send)
        except asyncio.CancelledError:
            # The watcher's cancel and no other (the server stopping): the client left.
            if not (state["left"] and task.uncancel() == 0):
                raise
        finally:
            state["streaming"] = False
            watcher.remove_done_callback(gone)
            watcher.cancel()

    async def _send_events(self, send: Send) -> None:
        ended = False
        async for chunk in self.iterator:
            body = chunk if isinstance(chunk, bytes) else chunk.encode(self.encoding)
            ended = body.endswith(DONE)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
            if ended:  # nothing follows [DONE]: the generator is closed now, not when collected
                close = getattr(self.iterator, "aclose", None)
                if close is not None:
                    await close()
                break
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass  # a body's trailing empty message; the body itself was read before
