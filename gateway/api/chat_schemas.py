"""Wire schemas of POST /v1/chat/completions (msgspec).

The request is the chat service's (gateway/chat/request.py: every field OpenAI's API takes,
served, mapped, ignored or refused by name as docs/openai-api.md lists); a field OpenAI does not
know is refused by name at decoding.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.api.body import decode_naming_unknown
from gateway.chat.request import MAX_MESSAGES as MAX_MESSAGES
from gateway.chat.request import ChatCompletionRequest as ChatCompletionRequest
from gateway.chat.request import ChatMessage as ChatMessage
from gateway.chat.result import ChatChoice as ChatChoice
from gateway.chat.result import ChatCompletion as ChatCompletion
from gateway.chat.result import ChatResponseMessage as ChatResponseMessage
from gateway.completions.logprobs import ChatLogprobs
from gateway.completions.result import FinishReason as FinishReason
from gateway.completions.result import Usage


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """decode_body, with unknown fields refused by their path (`tools`, `messages[0].foo`)."""
    return decode_naming_unknown(body, ChatCompletionRequest)


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    # The name in a call's first delta only; then fragments of the arguments (the SDKs join
    # the fragments of a call, found by its index).
    arguments: str
    name: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of a call, as OpenAI streams one: the first carries its id, type and name."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: Literal["function"] | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    # A legacy caller's (`functions`) call, in place of tool_calls (its name first, as above).
    function_call: FunctionDelta | None = None


class ChatChunkChoice(msgspec.Struct):
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    index: int = 0
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: None = None
    service_tier: str = "default"  # on every chunk, as OpenAI sends it
    # With stream_options.include_usage: null on every chunk but the last, which has only usage
    # (OpenAI's shape); left out otherwise.
    usage: Usage | msgspec.UnsetType | None = msgspec.UNSET
