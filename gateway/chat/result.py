"""A finished chat completion as OpenAI's `chat.completion` object: what /v1/chat/completions
answers and what a batch item of that endpoint stores as its result."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.completions.result import FinishReason, Usage, finish_reason, usage
from gateway.dispatch.stream import Dispatch


class ChatResponseMessage(msgspec.Struct):
    content: str
    role: Literal["assistant"] = "assistant"
    refusal: None = None


class ChatChoice(msgspec.Struct):
    message: ChatResponseMessage
    finish_reason: FinishReason | None
    index: int = 0
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: None = None


async def collect_chat_completion(dispatch: Dispatch) -> ChatCompletion:
    """Runs a chat request to its end; raises GatewayError if it fails."""
    parts = [chunk.text async for chunk in dispatch.events()]
    prepared = dispatch.prepared
    message = ChatResponseMessage(content="".join(parts))
    return ChatCompletion(
        id=prepared.request_id,
        created=prepared.created,
        model=prepared.model,
        choices=[ChatChoice(message=message, finish_reason=finish_reason(dispatch.finish_reason))],
        usage=usage(dispatch),
    )
