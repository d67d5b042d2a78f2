"""What a client asks of /v1/completions, as the completion service takes it (msgspec, decoded
at the HTTP edge and from stored batch items alike). The fields a completion shares with a batch
item are declared once, in CompletionFields."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.completions.cache_salt import MAX_CLIENT_SALT_CHARS

# What a session key (session_id, prompt_cache_key) may hold: it is only compared, never stored.
MAX_SESSION_KEY_CHARS = 256
SessionKey = Annotated[str, msgspec.Meta(max_length=MAX_SESSION_KEY_CHARS)]

# OpenAI accepts a string, a list of strings, a list of token ids or a list of id lists;
# msgspec allows one array type per union, so the list is checked for homogeneity in prepare().
Prompt = str | list[str | int | list[int]]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # OpenAI pads its stream's events against length side channels unless told not to; this
    # gateway's events carry no padding, so either value is served.
    include_obfuscation: bool | None = None


class CompletionFields(msgspec.Struct, forbid_unknown_fields=True):
    """The prompt and generation fields of a completion. Fields we cannot honour are accepted
    only at their neutral value."""

    prompt: Prompt
    max_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Not OpenAI: replay an exact response length (benchmarks).
    ignore_eos: bool = False
    # vLLM's: split this key's prefix cache further (gateway/completions/cache_salt.py).
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_CLIENT_SALT_CHARS)] | None = None
    # Whose conversation this is, for session affinity (gateway/request_path/prepare.py):
    # OpenAI's cache-routing key, and the session id vLLM's and llm-d's clients send.
    prompt_cache_key: SessionKey | None = None
    session_id: SessionKey | None = None


class CompletionRequest(CompletionFields, kw_only=True):
    """POST /v1/completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
