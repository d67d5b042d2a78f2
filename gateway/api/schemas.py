"""Wire schemas of the OpenAI-compatible API (msgspec). The ORM models are separate."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# OpenAI accepts a string, a list of strings, a list of token ids or a list of id lists;
# msgspec allows one array type per union, so the list is checked for homogeneity in prepare().
Prompt = str | list[str | int | list[int]]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/completions. Fields we cannot honour are accepted only at their neutral value."""

    model: str
    prompt: Prompt
    max_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
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


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(msgspec.Struct):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int = 0
    owned_by: str = "fedllm"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
