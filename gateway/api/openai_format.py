"""Turns a dispatch's site chunks into OpenAI completion objects: one JSON body, or SSE events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, cast

import msgspec

from gateway.api.errors import OpenAIError
from gateway.api.schemas import Completion, CompletionChoice, Usage
from gateway.completions import Dispatch, PreparedCompletion

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
