"""How a batch ends: the status its items' counters settle it in, expiry, and cancelling what
has not started. Shared by the batch store (an item's last move), the leases (a lapsed or expired
batch) and finalization (the files written, the final status given); each runs inside the
caller's transaction.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, Update, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.batches.records import ItemResult, settled_status
from gateway.db.models import (
    BatchItem,
    BatchItemStatus,
    BatchJob,
    BatchStatus,
    InferenceRequest,
    RequestStatus,
    utcnow,
)
from gateway.stores.pages import rowcount

OPEN_BATCH = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)
# The error an item cancelled with its batch reports (OpenAI's error shape).
CANCELLED_ERROR: dict[str, object] = {
    "message": "the batch was cancelled before this request finished",
    "type": "cancelled",
    "code": "batch_cancelled",
}
# The error of an item its batch's completion window left unfinished (OpenAI's code).
EXPIRED_ERROR: dict[str, object] = {
    "message": "This request could not be executed before the completion window expired.",
    "type": "expired",
    "code": "batch_expired",
}


def update_open(batch_id: str, *conditions: ColumnElement[bool]) -> Update:
    """An update of the batch that applies only while it is open and `conditions` hold: one that
    another gateway has settled meanwhile is left as it is."""
    return update(BatchJob).where(
        BatchJob.id == batch_id, BatchJob.status.in_(OPEN_BATCH), *conditions
    )


async def expire_in(session: AsyncSession, batch_id: str) -> None:
    marked = await session.execute(
        update_open(
            batch_id,
            BatchJob.expired_at.is_(None),
            BatchJob.finalizing_at.is_(None),  # every item final already: not expired
        ).values(expired_at=utcnow())
    )
    if not rowcount(marked):
        return
    expired = await cancel_queued(session, batch_id, EXPIRED_ERROR)
    batch = await session.get(BatchJob, batch_id, with_for_update=True, populate_existing=True)
    if batch is not None:
        batch.cancelled += expired
        settle(batch)


async def cancel_queued(
    session: AsyncSession, batch_id: str, error: dict[str, object] = CANCELLED_ERROR
) -> int:
    result = await session.execute(
        update(BatchItem)
        .where(BatchItem.batch_id == batch_id, BatchItem.status == BatchItemStatus.QUEUED)
        .values(status=BatchItemStatus.CANCELLED, error=error, finished_at=utcnow())
    )
    return rowcount(result)


def final_status(batch: BatchJob) -> BatchStatus | None:
    """The status the batch ends with once its files are written; None while some item is
    not final."""
    return settled_status(
        total=batch.total,
        completed=batch.completed,
        failed=batch.failed,
        cancelled=batch.cancelled,
        cancel_requested=batch.cancelling_at is not None,
        expired=batch.expired_at is not None,
    )


def settle(batch: BatchJob) -> None:
    """Once none of an open batch's items is left to run, its files are to be written:
    `finalizing` (a cancelled batch stays `cancelling` until then, as OpenAI shows it). Its
    runner writes them and gives the batch its final status (gateway/batches/finalize.py)."""
    if batch.status not in OPEN_BATCH or batch.finalizing_at is not None:
        return
    if final_status(batch) is not None:
        batch.finalizing_at = utcnow()
        if batch.status != BatchStatus.CANCELLING:
            batch.status = BatchStatus.FINALIZING


_REQUEST_STATUS = {
    BatchItemStatus.COMPLETED: RequestStatus.COMPLETED,
    BatchItemStatus.FAILED: RequestStatus.FAILED,
    BatchItemStatus.CANCELLED: RequestStatus.CANCELLED,
}


async def settle_request_row(
    session: AsyncSession, batch_id: str, index: int, result: ItemResult
) -> None:
    """Gives the request row of the item's last start the item's final status, in the
    transaction that records the item. Its full outcome (first token, attempts, ...) comes
    through the request log, written behind in batches: a gateway that stops in between
    would otherwise leave the row `dispatched` beside a final item, and the key's usage
    without the answer's tokens. A row already final is left as it is."""
    completion = result.completion or {}
    usage = completion.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    choices = completion.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    reason = first.get("finish_reason") if isinstance(first, dict) else None
    started_as = (
        select(BatchItem.request_id)
        .where(BatchItem.batch_id == batch_id, BatchItem.item_index == index)
        .scalar_subquery()
    )
    await session.execute(
        update(InferenceRequest)
        .where(
            InferenceRequest.id == started_as,
            InferenceRequest.status == RequestStatus.DISPATCHED,
        )
        .values(
            status=_REQUEST_STATUS[result.status],
            completion_tokens=tokens if isinstance(tokens, int) else None,
            finish_reason=reason if isinstance(reason, str) else None,
            error=None if result.error is None else str(result.error.get("message", "")),
            finished_at=utcnow(),
        )
    )
