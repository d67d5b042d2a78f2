"""A finished chat completion as OpenAI's `chat.completion` object: what /v1/chat/completions
answers and what a batch item of that endpoint stores as its result."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.chat.tool_calls import FunctionCall, ToolCall, split_finished
from gateway.completions.logprobs import ChatLogprobs, chat_logprobs
from gateway.completions.result import (
    ChoiceAnswer,
    FinishReason,
    Usage,
    collect_choices,
    token_bytes,
    usage,
)
from gateway.completions.sampling_options import served_tier
from gateway.dispatch.request import ToolCallParsing
from gateway.dispatch.stream import Dispatch


class ChatResponseMessage(msgspec.Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    # A legacy caller's (`functions`) call, in place of tool_calls; left out otherwise.
    function_call: FunctionCall | msgspec.UnsetType = msgspec.UNSET


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
    service_tier: str = "default"  # the tier it was served in (served_tier), as OpenAI tells it


def chat_message(
    text: str, reason: FinishReason | None, parsing: ToolCallParsing | None
) -> tuple[ChatResponseMessage, FinishReason | None]:
    """An answer's text as the assistant's message (its tool calls parsed out when the request
    offered tools) and the finish reason it is told with."""
    if parsing is None:
        return ChatResponseMessage(content=text), reason
    split = split_finished(text, parsing, reason)
    if parsing.legacy_functions:
        # A legacy caller's answer holds one call, as OpenAI's did before parallel calls.
        message = ChatResponseMessage(content=split.content)
        if split.calls:
            message.function_call = split.calls[0].function
        return message, split.finish_reason
    return ChatResponseMessage(split.content, tool_calls=split.calls or None), split.finish_reason


def chat_choice(dispatch: Dispatch, answer: ChoiceAnswer) -> ChatChoice:
    prepared = dispatch.prepared
    message, reason = chat_message(answer.text, answer.finish_reason, prepared.tool_calls)
    logprobs = None
    if prepared.params.options.logprobs:
        own = token_bytes(dispatch)
        logprobs = ChatLogprobs(chat_logprobs(answer.token_ids, answer.logprobs, own))
    return ChatChoice(message, reason, answer.index, logprobs)


async def collect_chat_completion(dispatch: Dispatch) -> ChatCompletion:
    """Runs a chat request to its end; raises GatewayError if it fails."""
    answers = await collect_choices(dispatch)
    prepared = dispatch.prepared
    return ChatCompletion(
        id=prepared.request_id,
        created=prepared.created,
        model=prepared.served_model,
        choices=[chat_choice(dispatch, answer) for answer in answers],
        usage=usage(dispatch),
        service_tier=served_tier(prepared.params.options.priority),
    )
