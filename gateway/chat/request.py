"""What a client asks of POST /v1/chat/completions, as the chat service takes it (msgspec).

Only what the gateway honours is accepted. OpenAI fields it cannot honour are declared when
clients commonly send them at a neutral value (store=false, ...), so that value passes and any
other is refused by name (gateway/chat/service.py); every other field (functions, audio, ...)
is unknown and refused by name at decoding (gateway/api/chat_schemas.py).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from gateway.completions.cache_salt import MAX_CLIENT_SALT_CHARS
from gateway.completions.request import SessionKey, StreamOptions

MAX_MESSAGES = 2048
MAX_TOOLS = 128  # OpenAI's bound


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    # A string or a list of parts; only {"type": "text", "text": ...} parts are served.
    content: str | list[dict[str, Any]] | None = None
    name: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # An assistant turn's tool calls, and a tool turn's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # Known OpenAI message fields this gateway refuses unless null (legacy functions, audio).
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
    # Accepted only at their neutral value.
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    # Not OpenAI: replay an exact response length (benchmarks), as in /v1/completions.
    ignore_eos: bool = False
    # vLLM's: split this key's prefix cache further (gateway/completions/cache_salt.py).
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_CLIENT_SALT_CHARS)] | None = None
    # Whose conversation this is, for session affinity (gateway/request_path/prepare.py):
    # OpenAI's cache-routing key, and the session id vLLM's and llm-d's clients send.
    prompt_cache_key: SessionKey | None = None
    session_id: SessionKey | None = None
