"""Wire schemas of the batch API (msgspec), shaped like OpenAI's batch objects. The ORM models
are separate (gateway/db/models.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import msgspec

from gateway.api.errors import ErrorBody, invalid_request
from gateway.api.schemas import Completion, CompletionRequest, Prompt

BatchStatusName = Literal[
    "validating", "in_progress", "completed", "failed", "cancelling", "cancelled"
]
ItemStatusName = Literal["queued", "running", "completed", "failed", "cancelled"]


class BatchRequestItem(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One request of a batch: the client's custom_id and the body fields of /v1/completions,
    less `model` (the batch names it) and streaming (results are collected, not streamed).
    Validated exactly as /v1/completions validates them."""

    custom_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
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
    ignore_eos: bool = False


class BatchCreateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/batches. metadata follows OpenAI's rules: up to 16 pairs, keys up to 64
    characters, values up to 512."""

    model: str
    requests: list[BatchRequestItem]
    metadata: dict[str, str] | None = None


class RequestCounts(msgspec.Struct):
    total: int
    completed: int
    failed: int


class Batch(msgspec.Struct):
    id: str
    model: str
    status: BatchStatusName
    created_at: int
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    in_progress_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    object: Literal["batch"] = "batch"
    endpoint: Literal["/v1/completions"] = "/v1/completions"


class BatchList(msgspec.Struct):
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class ItemAssignment(msgspec.Struct):
    """Where the group-wise assignment put the item, with the answer length it planned with
    (the prediction capped at max_tokens; null without a predictor) and why."""

    site: str | None
    predicted_tokens: int | None
    reason: str | None


class BatchResult(msgspec.Struct):
    """One item's outcome: `response` when completed, `error` when failed or cancelled."""

    custom_id: str
    status: ItemStatusName
    assignment: ItemAssignment
    response: Completion | None = None
    error: ErrorBody | None = None


class BatchResultList(msgspec.Struct):
    data: list[BatchResult]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


def item_body(item: BatchRequestItem) -> dict[str, object]:
    """The item as stored: the fields that differ from their defaults, less custom_id."""
    body = cast(dict[str, object], msgspec.to_builtins(item))
    del body["custom_id"]
    return body


def completion_request(model: str, body: dict[str, Any]) -> CompletionRequest:
    """A stored item as the /v1/completions request it stands for."""
    try:
        return msgspec.convert({**body, "model": model}, CompletionRequest)
    except msgspec.ValidationError as exc:
        raise invalid_request(f"invalid request: {exc}") from exc
