"""A dispatched Responses request run to its end: its events as they come (a stream) or its
finished `response` (a whole answer), both from one OutputBuilder over the site's chunks.

Events follow the Responses API: response.created and response.in_progress first, then per
output item its added/delta/done events, then response.completed (or response.incomplete when
the answer was cut at max_output_tokens) carrying the finished response, each with its
sequence_number. A failure after the stream began is an `error` event and response.failed.
The response is stored (when asked) before its last event goes out, so a client that continues
from it at once finds it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.completions.result import usage
from gateway.dispatch.stream import Dispatch
from gateway.errors import GatewayError, RateLimited
from gateway.responses.output import ErrorEvent, Event, LifecycleEvent, OutputBuilder
from gateway.responses.result import ResponseObject, failed, finished

Save = Callable[[ResponseObject], Awaitable[None]]


async def collect_response(dispatch: Dispatch, draft: ResponseObject) -> ResponseObject:
    """Runs the request to its end; raises GatewayError if it fails."""
    builder = OutputBuilder(dispatch.prepared.tool_calls)
    reason: str | None = None
    async for chunk in dispatch.events():
        builder.feed(chunk.text)
        reason = chunk.finish_reason or reason
    builder.finish(reason)
    return finished(draft, builder.items, reason, usage(dispatch))


def _failure_code(error: GatewayError) -> str:
    """The Responses API's error code for a response that failed while it was generated."""
    return "rate_limit_exceeded" if isinstance(error, RateLimited) else "server_error"


async def response_events(
    dispatch: Dispatch, draft: ResponseObject, save: Save
) -> AsyncIterator[Event]:
    """The stream's events in order, numbered; `save` stores the finished response."""
    number = 0

    def numbered(event: Event) -> Event:
        nonlocal number
        event.sequence_number = number
        number += 1
        return event

    yield numbered(LifecycleEvent("response.created", draft))
    yield numbered(LifecycleEvent("response.in_progress", draft))
    builder = OutputBuilder(dispatch.prepared.tool_calls)
    reason: str | None = None
    try:
        async for chunk in dispatch.events():
            for event in builder.feed(chunk.text):
                yield numbered(event)
            reason = chunk.finish_reason or reason
        for event in builder.finish(reason):
            yield numbered(event)
        final = finished(draft, builder.items, reason, usage(dispatch))
        await save(final)
    except GatewayError as exc:
        code = exc.code or _failure_code(exc)
        yield numbered(ErrorEvent(exc.message, code, exc.param))
        yield numbered(
            LifecycleEvent("response.failed", failed(draft, _failure_code(exc), exc.message))
        )
        return
    last = "response.completed" if final.status == "completed" else "response.incomplete"
    yield numbered(LifecycleEvent(last, final))
