"""What a client asks of POST /v1/chat/completions, as the chat service takes it (msgspec).

Every field OpenAI's API takes is declared with OpenAI's types, so a value OpenAI would refuse
(a wrong type, an unknown enum value, metadata past its bounds) is a 400 naming it. What the
gateway does with each (docs/openai-api.md, "Parameters"): most are served; the legacy
`functions`/`function_call` are mapped onto tools (gateway/chat/legacy_functions.py); hints
that change no answer here (metadata, store, reasoning_effort, verbosity, prediction,
safety_identifier, prompt caching options) are accepted and ignored; `service_tier` picks the
priority class ("flex" is served in the flex class, every other tier as "default") and is
echoed in the answer; and what would need a capability no model here has (audio output, web
search, moderation) is refused by name unless null (gateway/chat/service.py). A field OpenAI
does not know is refused by name at decoding (gateway/api/chat_schemas.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.completions.cache_salt import MAX_CLIENT_SALT_CHARS
from gateway.completions.request import SessionKey, StreamOptions

MAX_MESSAGES = 2048
MAX_TOOLS = 128  # OpenAI's bound

# OpenAI's metadata: up to 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=16),
]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
# "in-memory" is how OpenAI's reference first spelled it, "in_memory" how its SDKs now do.
CacheRetention = Literal["in_memory", "in-memory", "24h"]


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class Prediction(msgspec.Struct, forbid_unknown_fields=True):
    """Predicted Outputs: text the answer is expected to repeat, a speed hint at OpenAI."""

    type: Literal["content"]
    content: str | list[TextPart]


class PromptCacheOptions(msgspec.Struct, forbid_unknown_fields=True):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    # A string or a list of parts; only {"type": "text", "text": ...} parts are served.
    content: str | list[dict[str, Any]] | None = None
    name: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # An assistant turn's tool calls, and a tool turn's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # A legacy assistant turn's call ({"name", "arguments"}), answered by a `function` turn
    # named after the function (gateway/chat/turns.py).
    function_call: dict[str, Any] | None = None
    # An earlier audio answer ({"id"}): refused unless null, no model here speaks.
    audio: dict[str, Any] | None = None
    # An assistant turn's refusal: its text when the turn has no content.
    refusal: str | None = None


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
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {...}}.
    response_format: dict[str, Any] | None = None
    # [{"type": "function", "function": {"name", "description", "parameters", "strict"}}].
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Deprecated by OpenAI for tools and tool_choice, still sent by older clients: mapped onto
    # them, and answered in their shape (message.function_call).
    functions: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    # "none" | "auto" | {"name": ...}.
    function_call: str | dict[str, Any] | None = None
    # Accepted and ignored: they change no answer of this gateway.
    metadata: Metadata | None = None
    store: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: Prediction | None = None
    # Served: "flex" in the flex class, the others at the default (interactive) one.
    service_tier: ServiceTier | None = None
    safety_identifier: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    prompt_cache_retention: CacheRetention | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # Refused unless text only / null: capabilities no model of this gateway has.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # Not OpenAI: replay an exact response length (benchmarks), as in /v1/completions.
    ignore_eos: bool = False
    # vLLM's: split this key's prefix cache further (gateway/completions/cache_salt.py).
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_CLIENT_SALT_CHARS)] | None = None
    # Whose conversation this is, for session affinity (gateway/request_path/prepare.py):
    # OpenAI's cache-routing key, and the session id vLLM's and llm-d's clients send.
    prompt_cache_key: SessionKey | None = None
    session_id: SessionKey | None = None
