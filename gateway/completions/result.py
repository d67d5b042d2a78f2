"""A finished completion as OpenAI's `text_completion` object: what /v1/completions answers and
what a batch item stores as its result."""

from __future__ import annotations

from typing import Literal, cast

import msgspec

from gateway.dispatch.stream import Dispatch

FinishReason = Literal["stop", "length"]


class PromptTokensDetails(msgspec.Struct):
    # Prompt tokens the site took from its prefix cache instead of computing them.
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class CompletionChoice(msgspec.Struct):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def finish_reason(reason: str | None) -> FinishReason | None:
    """The finish reasons a client is told ("stop", "length"); others end in an error."""
    return cast(FinishReason, reason) if reason in ("stop", "length") else None


def usage(dispatch: Dispatch) -> Usage:
    prompt = len(dispatch.prepared.params.prompt_token_ids)
    completion = dispatch.completion_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=dispatch.cached_prompt_tokens),
    )


async def collect_completion(dispatch: Dispatch) -> Completion:
    """Runs the request to its end; raises GatewayError if it fails."""
    parts = [chunk.text async for chunk in dispatch.events()]
    prepared = dispatch.prepared
    return Completion(
        id=prepared.request_id,
        object="text_completion",
        created=prepared.created,
        model=prepared.model,
        choices=[
            CompletionChoice(
                text="".join(parts), finish_reason=finish_reason(dispatch.finish_reason)
            )
        ],
        usage=usage(dispatch),
    )
