"""The `response` object of the Responses API: what POST /v1/responses answers (whole, or in
its stream's first and last events), what GET /v1/responses/{id} reads back and what a stored
response keeps. Shapes follow the openai SDK's `openai.types.responses.Response`."""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from gateway.completions.result import Usage
from gateway.responses.items import OutputItem

Status = Literal["completed", "failed", "in_progress", "incomplete"]


class InputTokensDetails(msgspec.Struct):
    # Prompt tokens the site took from its prefix cache instead of computing them.
    cached_tokens: int = 0
    # What OpenAI bills for explicit cache writes: the prefix cache here is automatic and its
    # writes cost nothing apart.
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
        ),
    )


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class Reasoning(msgspec.Struct):
    effort: None = None
    summary: None = None


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: Status
    output: list[OutputItem]
    object: Literal["response"] = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    safety_identifier: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    # {"format": {"type": "text"} | the json_schema / json_object format asked for,
    #  "verbosity": "medium"}
    text: dict[str, Any] = msgspec.field(default_factory=dict)
    # "none" | "auto" | "required" | {"type": "function", "name": ...}
    tool_choice: str | dict[str, Any] = "auto"
    # The function tools as given ({"type": "function", "name", "parameters", ...}).
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    background: bool = False
    completed_at: int | None = None


def finished(
    draft: ResponseObject,
    output: list[OutputItem],
    finish_reason: str | None,
    usage: Usage,
) -> ResponseObject:
    """The draft once its answer is whole: `completed`, or `incomplete` when it was cut at
    max_output_tokens."""
    cut = finish_reason == "length"
    return msgspec.structs.replace(
        draft,
        status="incomplete" if cut else "completed",
        output=output,
        incomplete_details=IncompleteDetails("max_output_tokens") if cut else None,
        usage=response_usage(usage),
        completed_at=None if cut else int(time.time()),
    )


def failed(draft: ResponseObject, code: str, message: str) -> ResponseObject:
    return msgspec.structs.replace(draft, status="failed", error=ResponseError(code, message))
