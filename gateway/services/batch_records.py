"""The plain records of the batch API: what the store takes and returns, free of SQL.

BatchStore (gateway/services/batches.py) reads and writes them; the runner, the controllers and
the leases pass them around.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from gateway.db.models import BatchItem, BatchItemStatus, BatchJob, BatchStatus
from gateway.routing.types import UnpredictedPlan, planned_answer_tokens

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NewItem:
    custom_id: str
    body: dict[str, object]  # the item as submitted, less custom_id
    prompt_tokens: int
    max_tokens: int


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

    def lane_key(self, unpredicted: UnpredictedPlan = "max_tokens") -> LaneKey:
        """Where the item stands in its lane (BatchStore.lane): planned answer tokens and its
        index. The stored prediction is already capped at max_tokens (the runner assigns the
        capped one), so it is used as is, as the lane's SQL does."""
        if self.predicted_tokens is not None:
            return self.predicted_tokens, self.index
        return planned_answer_tokens(None, self.max_tokens, unpredicted), self.index


@dataclass(frozen=True, slots=True)
class ItemAssignment:
    index: int
    site_id: int | None
    predicted_tokens: int | None
    predicted_bucket: int | None
    predictor_version: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class ItemResult:
    status: BatchItemStatus  # completed, failed or cancelled
    completion: dict[str, object] | None = None
    error: dict[str, object] | None = None


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    data: list[T]
    has_more: bool


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
    )
