"""A finished completion as OpenAI's `text_completion` object: what /v1/completions answers and
what a batch item stores as its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast

import msgspec

from gateway.completions.logprobs import (
    CompletionLogprobs,
    TextOffsets,
    TokenBytes,
    completion_logprobs,
)
from gateway.dispatch.stream import Dispatch
from gateway.sites.interface import SiteChunk, TokenLogprob

# "function_call": a chat answer's call to a legacy caller's `functions` (gateway/chat/).
FinishReason = Literal["stop", "length", "tool_calls", "function_call"]


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
    logprobs: CompletionLogprobs | None = None
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


@dataclass(slots=True)
class ChoiceAnswer:
    """One choice's answer, gathered from its chunks."""

    index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, chunk: SiteChunk) -> None:
        self.texts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = finish_reason(chunk.finish_reason)


async def collect_choices(dispatch: Dispatch) -> list[ChoiceAnswer]:
    """Runs the request to its end: every choice's answer, by index; raises GatewayError."""
    choices = [ChoiceAnswer(i) for i in range(dispatch.prepared.params.options.n)]
    async for chunk in dispatch.events():
        choices[chunk.index].add(chunk)
    return choices


def token_bytes(dispatch: Dispatch) -> TokenBytes:
    """Each token's own bytes, by the tokenizer of the request's model."""
    model, of = dispatch.prepared.model, dispatch.placement.token_bytes
    return lambda token_id: of(model, token_id)


def usage(dispatch: Dispatch) -> Usage:
    prompt = len(dispatch.prepared.params.prompt_token_ids)
    completion = dispatch.completion_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=dispatch.cached_prompt_tokens),
    )


def completion_choice(dispatch: Dispatch, answer: ChoiceAnswer) -> CompletionChoice:
    prepared = dispatch.prepared
    echo = prepared.echo or ""
    logprobs = None
    if prepared.params.options.logprobs:
        logprobs = completion_logprobs(
            answer.token_ids, answer.logprobs, token_bytes(dispatch), TextOffsets(len(echo))
        )
    return CompletionChoice(echo + answer.text, answer.index, logprobs, answer.finish_reason)


async def collect_completion(dispatch: Dispatch) -> Completion:
    """Runs the request to its end; raises GatewayError if it fails."""
    answers = await collect_choices(dispatch)
    prepared = dispatch.prepared
    return Completion(
        id=prepared.request_id,
        object="text_completion",
        created=prepared.created,
        model=prepared.served_model,
        choices=[completion_choice(dispatch, answer) for answer in answers],
        usage=usage(dispatch),
    )
