"""Wire schemas of POST /v1/chat/completions (msgspec).

Only what the gateway honours is accepted. OpenAI fields it cannot honour are declared when
clients commonly send them at a neutral value (n=1, logprobs=false, ...), so that value passes
and any other is refused by name (gateway/chat.py); every other field (tools, functions, audio,
...) is unknown and refused by name at decoding.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from gateway.api.body import decode_body
from gateway.api.errors import OpenAIError, invalid_request
from gateway.api.schemas import StreamOptions, Usage

MAX_MESSAGES = 2048
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`(?: - at `\$\.?([^`]*)`)?")


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    # A string or a list of parts; only {"type": "text", "text": ...} parts are served.
    content: str | list[dict[str, Any]] | None = None
    # Known OpenAI message fields this gateway refuses unless null (tool use, audio, names).
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None
    refusal: Any = None


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    # Far more turns than any context holds; bounds the template rendering one request costs.
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # Accepted only at their neutral value.
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: Any = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    # Not OpenAI: replay an exact response length (benchmarks), as in /v1/completions.
    ignore_eos: bool = False


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """decode_body, with unknown fields refused by their path (`tools`, `messages[0].foo`)."""
    try:
        return decode_body(body, ChatCompletionRequest)
    except OpenAIError as exc:
        match = _UNKNOWN_FIELD.search(exc.body.message)
        if match is None:
            raise
        field, where = match.groups()
        param = f"{where}.{field}" if where else field
        raise invalid_request(
            f"'{param}' is not supported by this gateway (unknown or unsupported parameter)",
            param=param,
        ) from exc


class ChatResponseMessage(msgspec.Struct):
    content: str
    role: Literal["assistant"] = "assistant"
    refusal: None = None


FinishReason = Literal["stop", "length"]


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


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    index: int = 0
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: None = None
    # With stream_options.include_usage: null on every chunk but the last, which has only usage
    # (OpenAI's shape); left out otherwise.
    usage: Usage | msgspec.UnsetType | None = msgspec.UNSET
