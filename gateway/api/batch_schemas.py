"""Wire schemas of the batch API (msgspec), shaped like OpenAI's batch objects. The ORM models
are separate (gateway/db/models.py)."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.api.openai_errors import ErrorBody
from gateway.batches.request import BatchCreateRequest as BatchCreateRequest
from gateway.batches.request import BatchCreateSchema as BatchCreateSchema
from gateway.batches.request import BatchRequestItem as BatchRequestItem

BatchStatusName = Literal[
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
]
ItemStatusName = Literal["queued", "running", "completed", "failed", "cancelled"]


class RequestCounts(msgspec.Struct):
    total: int
    completed: int
    failed: int


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class BatchUsage(msgspec.Struct):
    """OpenAI's batch usage: the tokens of the answered requests."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class BatchProgress(msgspec.Struct):
    """This gateway's extension: how far the batch is, by the tokens its plan expects (each
    item's prompt plus its predicted answer, else max_tokens), and the seconds it is estimated
    to need still at the rate it has finished work so far (null before any item is final)."""

    planned_tokens: int
    finished_tokens: int
    fraction: float
    eta_seconds: float | None = None


class Batch(msgspec.Struct):
    """OpenAI's batch object. An inline batch (this gateway's extension) has no input file
    and, unless it asked for one, no completion window."""

    id: str
    endpoint: str
    status: BatchStatusName
    created_at: int
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    model: str
    # Defaults, so that a batch stored for an Idempotency-Key replay before these fields
    # existed still reads back.
    input_file_id: str | None = None
    completion_window: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    # Validation errors of the input file as a whole (a malformed file, lines for another
    # endpoint or model): this gateway refuses such a batch at creation (400 naming the line),
    # so a batch it created never has any. A line its endpoint refuses is that line's entry
    # in the error file instead.
    errors: None = None
    usage: BatchUsage | None = None
    progress: BatchProgress | None = None
    object: Literal["batch"] = "batch"


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
    """One item's outcome: `response` when completed (the endpoint's answer object: a
    text_completion, or a chat.completion), `error` when failed or cancelled."""

    custom_id: str
    status: ItemStatusName
    assignment: ItemAssignment
    response: dict[str, object] | None = None
    error: ErrorBody | None = None


class BatchResultList(msgspec.Struct):
    data: list[BatchResult]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"
