"""A finished chat completion as OpenAI's `chat.completion` object: what /v1/chat/completions
answers and what a batch item of that endpoint stores as its result."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.chat.tool_calls import ToolCall, split_answer
from gateway.completions.logprobs import ChatLogprobs, chat_logprobs
from gateway.completions.result import (
    ChoiceAnswer,
    FinishReason,
    Usage,
    collect_choices,
    token_decoder,
    usage,
)
from gateway.dispatch.stream import Dispatch


class ChatResponseMessage(msgspec.Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    message: ChatResponseMessage
    finish_reason: FinishReason | None
    index: int = 0
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: None = None


def chat_choice(dispatch: Dispatch, answer: ChoiceAnswer) -> ChatChoice:
    prepared = dispatch.prepared
    content: str | None = answer.text
    calls: list[ToolCall] = []
    reason = answer.finish_reason
    if prepared.tool_calls is not None and content is not None:
        content, calls = split_answer(content, prepared.tool_calls)
        if calls and reason == "stop":
            reason = "tool_calls"
    logprobs = None
    if prepared.params.logprobs:
        decode = token_decoder(dispatch)
        logprobs = ChatLogprobs(chat_logprobs(answer.token_ids, answer.logprobs, decode))
    message = ChatResponseMessage(content=content, tool_calls=calls or None)
    return ChatChoice(message, reason, answer.index, logprobs)


async def collect_chat_completion(dispatch: Dispatch) -> ChatCompletion:
    """Runs a chat request to its end; raises GatewayError if it fails."""
    answers = await collect_choices(dispatch)
    prepared = dispatch.prepared
    return ChatCompletion(
        id=prepared.request_id,
        created=prepared.created,
        model=prepared.model,
        choices=[chat_choice(dispatch, answer) for answer in answers],
        usage=usage(dispatch),
    )
