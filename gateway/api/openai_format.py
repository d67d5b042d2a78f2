"""Turns a dispatch's site chunks into OpenAI completion and chat completion objects: one JSON
body, or SSE events."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from gateway.api.chat_schemas import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from gateway.api.openai_errors import OpenAIError, error_envelope
from gateway.chat.result import collect_chat_completion
from gateway.completions.result import (
    Completion,
    CompletionChoice,
    Usage,
    collect_completion,
    finish_reason,
    usage,
)
from gateway.completions.service import PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.errors import GatewayError

__all__ = [
    "chat_completion_events",
    "collect_chat_completion",
    "collect_completion",
    "completion_events",
]


def _chunk(
    prepared: PreparedCompletion, choices: list[CompletionChoice], counts: Usage | None = None
) -> Completion:
    return Completion(
        prepared.request_id, "text_completion", prepared.created, prepared.model, choices, counts
    )


def _event(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def completion_events(dispatch: Dispatch) -> AsyncIterator[bytes]:
    """SSE stream: one event per site chunk, an optional usage event, then [DONE].

    A failure after the stream started can no longer change the HTTP status, so it is sent as an
    error event (the shape OpenAI uses), followed by [DONE].
    """
    prepared = dispatch.prepared
    try:
        async for chunk in dispatch.events():
            choice = CompletionChoice(
                text=chunk.text, finish_reason=finish_reason(chunk.finish_reason)
            )
            yield _event(_chunk(prepared, [choice]))
        if prepared.include_usage:
            yield _event(_chunk(prepared, [], usage(dispatch)))
    except (OpenAIError, GatewayError) as exc:
        yield _event(error_envelope(exc))
    yield b"data: [DONE]\n\n"


def _chat_chunk(
    prepared: PreparedCompletion,
    choices: list[ChatChunkChoice],
    counts: Usage | msgspec.UnsetType | None = None,
) -> ChatCompletionChunk:
    if not prepared.include_usage:
        counts = msgspec.UNSET
    return ChatCompletionChunk(
        prepared.request_id, prepared.created, prepared.model, choices, usage=counts
    )


async def chat_completion_events(dispatch: Dispatch) -> AsyncIterator[bytes]:
    """SSE stream of chat.completion.chunk objects: the assistant role, content deltas, a chunk
    with the finish reason, an optional usage chunk, then [DONE]; errors as in
    completion_events.

    The role chunk waits for the site's first chunk so that everything is sent from inside
    dispatch.events(), which records the request as cancelled if the client goes away.
    """
    prepared = dispatch.prepared
    started = False
    try:
        async for chunk in dispatch.events():
            if not started:
                started = True
                role = ChatDelta(role="assistant", content="")
                yield _event(_chat_chunk(prepared, [ChatChunkChoice(role)]))
            if chunk.text:
                content = ChatDelta(content=chunk.text)
                yield _event(_chat_chunk(prepared, [ChatChunkChoice(content)]))
            if chunk.finish_reason is not None:
                end = ChatChunkChoice(ChatDelta(), finish_reason=finish_reason(chunk.finish_reason))
                yield _event(_chat_chunk(prepared, [end]))
        if prepared.include_usage:
            yield _event(_chat_chunk(prepared, [], usage(dispatch)))
    except (OpenAIError, GatewayError) as exc:
        yield _event(error_envelope(exc))
    yield b"data: [DONE]\n\n"
