"""What a client asks of POST /v1/responses, as the responses service takes it (msgspec).

As for chat (gateway/chat/request.py), only what the gateway honours is accepted: fields it cannot
honour are declared when clients commonly send them at a neutral value (background=false,
truncation="disabled", ...), so that value passes and any other is refused by name
(gateway/responses/unsupported.py); every other field is unknown and refused by name at decoding.
Input items, tools and `text` stay loosely typed here and are checked piece by piece, so that a
bad one is refused with its path (`input[2].content[0].type`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from gateway.chat.request import MAX_MESSAGES, MAX_TOOLS
from gateway.completions.request import SessionKey

# OpenAI's bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_RESPONSE_ID_CHARS = 64


class ResponseStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    # OpenAI pads stream events with random text against length side channels; this gateway
    # sends none, whatever is asked (docs/openai-api.md).
    include_obfuscation: bool | None = None


class ResponseCreateRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    # A string (one user message) or a list of items: messages, function calls, their outputs.
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_MESSAGES)] | None = (
        None
    )
    instructions: str | None = None
    previous_response_id: Annotated[str, msgspec.Meta(max_length=MAX_RESPONSE_ID_CHARS)] | None = (
        None
    )
    # Kept (and readable by GET /v1/responses/{id}) unless false.
    store: bool | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    max_output_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    # [{"type": "function", "name", "description", "parameters", "strict"}]
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    # "none" | "auto" | "required" | {"type": "function", "name": ...}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity": ...}
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    safety_identifier: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    prompt_cache_key: SessionKey | None = None
    # Bounds calls of built-in tools, of which this gateway has none: any value holds.
    max_tool_calls: int | None = None
    # Accepted only at their neutral value.
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    prompt: Any = None
    conversation: Any = None
