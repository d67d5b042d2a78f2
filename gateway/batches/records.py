"""The plain records of the batch API: what the store takes and returns, free of SQL.

BatchStore (gateway/batches/store.py) reads and writes them; the runner, the controllers and
the leases pass them around.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from gateway.batches.progress import Progress
from gateway.db.models import BatchItem, BatchItemStatus, BatchJob, BatchStatus

# Re-exported: the batch API's records are read through this module.
from gateway.stores.pages import Owner as Owner
from gateway.stores.pages import Page as Page


class NewItem(NamedTuple):
    """An item as the store writes it. A tuple of strings and numbers (its body as JSON text),
    not an object holding the body's dicts and lists: the garbage collector stops walking such
    tuples after their first collection, where a 90,000-item chat batch held as objects made
    every full collection hold the event loop ~200 ms while it was accepted
    (bench/results/batch_scale)."""

    custom_id: str
    body: str  # the item's request body as JSON text, less custom_id and model
    prompt_tokens: int
    max_tokens: int
    # An item its endpoint refused at submission (OpenAI's way: that line's entry in the error
    # file, not a 400 for the batch): the error body and the status the endpoint would answer.
    error: dict[str, object] | None = None
    status_code: int | None = None


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """The tokens a batch's answered items took (OpenAI's batch `usage`)."""

    input_tokens: int = 0
    output_tokens: int = 0
    # Of the input tokens, those the sites took from their prefix caches (each answer's
    # usage.prompt_tokens_details.cached_tokens).
    cached_input_tokens: int = 0


@dataclass(frozen=True, slots=True)
class NewBatch:
    id: str
    owner: Owner
    model: str
    endpoint: str
    metadata: dict[str, str] | None
    input_file_id: str | None = None
    completion_window: str | None = None
    expires_at: datetime | None = None
    # The moment expires_at counts from (None: when the store writes the row); one clock read
    # for both, so expires_at - created_at is the window exactly, not a second short.
    created_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class BatchView:
    id: str
    model: str
    status: BatchStatus
    metadata: dict[str, str] | None
    total: int
    completed: int
    failed: int
    cancelled: int
    created_at: datetime
    in_progress_at: datetime | None
    cancelling_at: datetime | None
    finished_at: datetime | None
    owner: Owner = None
    endpoint: str = "/v1/completions"
    input_file_id: str | None = None
    completion_window: str | None = None
    expires_at: datetime | None = None
    expired_at: datetime | None = None
    finalizing_at: datetime | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    usage: TokenUsage = TokenUsage()
    progress: Progress | None = None


@dataclass(frozen=True, slots=True)
class ItemView:
    """An item as its results show it."""

    index: int
    custom_id: str
    status: BatchItemStatus
    site: str | None  # where MICO assigned it
    predicted_tokens: int | None
    assign_reason: str | None
    attempts: int
    request_id: str | None
    completion: dict[str, object] | None
    error: dict[str, object] | None


LaneKey = tuple[int, int]


@dataclass(frozen=True, slots=True)
class QueuedItem:
    """An item as the runner starts it."""

    index: int
    custom_id: str
    body: dict[str, object]
    prompt_tokens: int
    max_tokens: int
    site_id: int | None
    predicted_tokens: int | None
    predicted_bucket: int | None
    predictor_version: str | None
    assign_reason: str | None
    attempts: int
    plan_rank: int = 0

    def lane_key(self) -> LaneKey:
        """Where the item stands in its lane (BatchStore.lane): its rank in the batch plan, then
        its index."""
        return self.plan_rank, self.index


@dataclass(frozen=True, slots=True)
class ItemAssignment:
    index: int
    site_id: int | None
    predicted_tokens: int | None
    predicted_bucket: int | None
    predictor_version: str | None
    reason: str
    # Its place in its site's order (gateway/batches/plan.py); None: submission order.
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class ItemResult:
    status: BatchItemStatus  # completed, failed or cancelled
    completion: dict[str, object] | None = None
    error: dict[str, object] | None = None
    # A failure's HTTP status, as the endpoint would have answered it (None: stopped).
    status_code: int | None = None


@dataclass(frozen=True, slots=True)
class FinalItem:
    """A final item as the batch's output or error file shows it."""

    index: int
    custom_id: str
    status: BatchItemStatus
    request_id: str | None
    completion: dict[str, object] | None
    error: dict[str, object] | None
    status_code: int | None


def batch_view(row: BatchJob) -> BatchView:
    return BatchView(
        id=row.id,
        model=row.model,
        status=row.status,
        metadata=row.meta,
        total=row.total,
        completed=row.completed,
        failed=row.failed,
        cancelled=row.cancelled,
        created_at=row.created_at,
        in_progress_at=row.in_progress_at,
        cancelling_at=row.cancelling_at,
        finished_at=row.finished_at,
        owner=row.api_key_id,
        endpoint=row.endpoint,
        input_file_id=row.input_file_id,
        completion_window=row.completion_window,
        expires_at=row.expires_at,
        expired_at=row.expired_at,
        finalizing_at=row.finalizing_at,
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
    )


def queued_item(row: BatchItem) -> QueuedItem:
    return QueuedItem(
        index=row.item_index,
        custom_id=row.custom_id,
        body=row.body,
        prompt_tokens=row.prompt_tokens,
        max_tokens=row.max_tokens,
        site_id=row.site_id,
        predicted_tokens=row.predicted_tokens,
        predicted_bucket=row.predicted_bucket,
        predictor_version=row.predictor_version,
        assign_reason=row.assign_reason,
        attempts=row.attempts,
        plan_rank=row.plan_rank,
    )


def settled_status(
    *,
    total: int,
    completed: int,
    failed: int,
    cancelled: int,
    cancel_requested: bool,
    expired: bool = False,
) -> BatchStatus | None:
    """Contract: None while some item is not final; once all are: cancelled if a cancel was
    asked, else expired if its window passed first, else cancelled if some item was, else
    completed if any item completed, else failed."""
    if completed + failed + cancelled < total:
        return None
    if cancel_requested:
        return BatchStatus.CANCELLED
    if expired:
        return BatchStatus.EXPIRED
    if cancelled:
        return BatchStatus.CANCELLED
    return BatchStatus.COMPLETED if completed else BatchStatus.FAILED
