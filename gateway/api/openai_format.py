"""Turns a dispatch's site chunks into OpenAI completion and chat completion objects: one JSON
body, or SSE events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, cast

import msgspec

from gateway.api.chat_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
)
from gateway.api.errors import OpenAIError
from gateway.api.schemas import Completion, CompletionChoice, Usage
from gateway.completions import PreparedCompletion
from gateway.dispatch import Dispatch

FinishReason = Literal["stop", "length"]


def _finish(reason: str | None) -> FinishReason | None:
    return cast(FinishReason, reason) if reason in ("stop", "length") else None


def _usage(dispatch: Dispatch) -> Usage:
    prompt = len(dispatch.prepared.params.prompt_token_ids)
    completion = dispatch.completion_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def collect_completion(dispatch: Dispatch) -> Completion:
    """Runs the request to its end; raises OpenAIError if it fails."""
    parts = [chunk.text async for chunk in dispatch.events()]
    prepared = dispatch.prepared
    return Completion(
        id=prepared.request_id,
        object="text_completion",
        created=prepared.created,
        model=prepared.model,
        choices=[
            CompletionChoice(text="".join(parts), finish_reason=_finish(dispatch.finish_reason))
        ],
        usage=_usage(dispatch),
    )


def _chunk(
    prepared: PreparedCompletion, choices: list[CompletionChoice], usage: Usage | None = None
) -> Completion:
    return Completion(
        prepared.request_id, "text_completion", prepared.created, prepared.model, choices, usage
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
            choice = CompletionChoice(text=chunk.text, finish_reason=_finish(chunk.finish_reason))
            yield _event(_chunk(prepared, [choice]))
        if prepared.include_usage:
            yield _event(_chunk(prepared, [], _usage(dispatch)))
    except OpenAIError as exc:
        yield _event(exc.envelope())
    yield b"data: [DONE]\n\n"


async def collect_chat_completion(dispatch: Dispatch) -> ChatCompletion:
    """Runs a chat request to its end; raises OpenAIError if it fails."""
    parts = [chunk.text async for chunk in dispatch.events()]
    prepared = dispatch.prepared
    message = ChatResponseMessage(content="".join(parts))
    return ChatCompletion(
        id=prepared.request_id,
        created=prepared.created,
        model=prepared.model,
        choices=[ChatChoice(message=message, finish_reason=_finish(dispatch.finish_reason))],
        usage=_usage(dispatch),
    )


def _chat_chunk(
    prepared: PreparedCompletion,
    choices: list[ChatChunkChoice],
    usage: Usage | msgspec.UnsetType | None = None,
) -> ChatCompletionChunk:
    if not prepared.include_usage:
        usage = msgspec.UNSET
    return ChatCompletionChunk(
        prepared.request_id, prepared.created, prepared.model, choices, usage=usage
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
                end = ChatChunkChoice(ChatDelta(), finish_reason=_finish(chunk.finish_reason))
                yield _event(_chat_chunk(prepared, [end]))
        if prepared.include_usage:
            yield _event(_chat_chunk(prepared, [], _usage(dispatch)))
    except OpenAIError as exc:
        yield _event(exc.envelope())
    yield b"data: [DONE]\n\n"
