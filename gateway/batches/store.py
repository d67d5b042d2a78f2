"""Batches and their items in the database: every read and write of the batch API and its runner.

Items move queued -> running -> completed / failed / cancelled. Each move is one conditional
UPDATE fenced by the item's `attempts` (the number of starts), so a runner that lost its batch to
another gateway cannot write over the new owner, and an item recorded final is never touched
again. A batch's counters change in the same transaction as the item that moves them, and the
batch settles (completed / failed / cancelled) in the transaction that finalizes its last item.

Which gateway runs a batch is gateway/batches/leases.py's business; the records taken
and returned are in gateway/batches/records.py; how a batch settles, expires and cancels
is gateway/batches/settling.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Select, Update, and_, or_, select, update

from gateway.batches.bulk import write_items
from gateway.batches.records import (
    BatchView,
    ItemAssignment,
    ItemResult,
    ItemView,
    LaneKey,
    NewBatch,
    NewItem,
    Owner,
    Page,
    QueuedItem,
    TokenUsage,
    batch_view,
    queued_item,
)
from gateway.batches.settling import (
    OPEN_BATCH,
    cancel_queued,
    expire_in,
    settle,
    settle_request_row,
)
from gateway.batches.totals import planned_work_query, usage_query
from gateway.db.models import BatchItem, BatchItemStatus, BatchJob, BatchStatus, Site, utcnow
from gateway.db.session import SessionStore
from gateway.stores.file_store import file_exists, owned_by
from gateway.stores.pages import rowcount

T = TypeVar("T")
_NOT_FINAL = (BatchItemStatus.QUEUED, BatchItemStatus.RUNNING)
# Rows per INSERT / UPDATE statement when a batch's items are written in bulk.
_CHUNK = 1000


def _page(rows: Sequence[T], limit: int) -> Page[T]:
    return Page(list(rows[:limit]), has_more=len(rows) > limit)


def _as_read(batch_id: str, index: int, attempts: int, status: ColumnElement[bool]) -> Update:
    """An update of the item that applies only while it is as its runner read it (`attempts`
    starts, `status`): one that lost the item to a cancel or another gateway changes nothing."""
    return update(BatchItem).where(
        BatchItem.batch_id == batch_id,
        BatchItem.item_index == index,
        status,
        BatchItem.attempts == attempts,
    )


class BatchStore(SessionStore):
    async def create(self, new: NewBatch, items: Sequence[NewItem]) -> BatchView | None:
        """The batch and all its items in one transaction: accepted whole or not at all. None,
        writing nothing, when its input file was deleted meanwhile."""
        async with self._sessions.begin() as session:
            if new.input_file_id is not None and not await file_exists(
                session, new.input_file_id, new.owner
            ):
                return None
            row = BatchJob(
                id=new.id,
                api_key_id=new.owner,
                model=new.model,
                endpoint=new.endpoint,
                input_file_id=new.input_file_id,
                completion_window=new.completion_window,
                expires_at=new.expires_at,
                status=BatchStatus.VALIDATING,
                meta=new.metadata,
                total=len(items),
                completed=0,
                failed=sum(1 for item in items if item.error is not None),
                cancelled=0,
                created_at=new.created_at or utcnow(),
            )
            session.add(row)
            await session.flush()
            await write_items(session, new.id, items)
            return batch_view(row)

    async def usage(self, batch_ids: Sequence[str]) -> dict[str, TokenUsage]:
        """The tokens each batch's answered items took, from their stored answers' usage."""
        if not batch_ids:
            return {}
        async with self._sessions() as session:
            rows = (await session.execute(usage_query(batch_ids))).all()
        return {row[0]: TokenUsage(int(row[1]), int(row[2]), int(row[3])) for row in rows}

    async def planned_work(self, batch_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Per batch: the planned tokens of all its items (prompt + the capped prediction, else
        max_tokens) and of those that are final (gateway/batches/progress.py)."""
        if not batch_ids:
            return {}
        async with self._sessions() as session:
            rows = (await session.execute(planned_work_query(batch_ids))).all()
        return {row[0]: (int(row[1]), int(row[2])) for row in rows}

    async def get(self, batch_id: str, owner: Owner) -> BatchView | None:
        """The owner's batch; None for one that does not exist or is another key's."""
        async with self._sessions() as session:
            row = await session.scalar(_mine(batch_id, owner))
            return batch_view(row) if row is not None else None

    async def list_batches(
        self, owner: Owner, after: str | None, limit: int
    ) -> Page[BatchView] | None:
        """The owner's batches newest first, from just after the batch `after`; None when
        `after` is not one of them."""
        query = (
            select(BatchJob)
            .where(owned_by(BatchJob.api_key_id, owner))
            .order_by(BatchJob.created_at.desc(), BatchJob.id.desc())
        )
        async with self._sessions() as session:
            if after is not None:
                cursor = await session.scalar(_mine(after, owner))
                if cursor is None:
                    return None
                query = query.where(
                    or_(
                        BatchJob.created_at < cursor.created_at,
                        and_(BatchJob.created_at == cursor.created_at, BatchJob.id < cursor.id),
                    )
                )
            rows = (await session.scalars(query.limit(limit + 1))).all()
            return _page([batch_view(row) for row in rows], limit)

    async def open_batches(self, limit: int) -> list[BatchView]:
        """Every owner's batches not yet final (the dashboard's Batches panel), oldest first."""
        query = select(BatchJob).where(BatchJob.status.in_(OPEN_BATCH))
        query = query.order_by(BatchJob.created_at, BatchJob.id).limit(limit)
        async with self._sessions() as session:
            return [batch_view(row) for row in (await session.scalars(query)).all()]

    async def results(self, batch_id: str, after: str | None, limit: int) -> Page[ItemView] | None:
        """Items in submission order, from just after the one with custom_id `after`; None when
        `after` names no item of the batch. (The caller checked that the batch is the
        caller's.)"""
        query = (
            select(BatchItem, Site.name)
            .outerjoin(Site, Site.id == BatchItem.site_id)
            .where(BatchItem.batch_id == batch_id)
            .order_by(BatchItem.item_index)
        )
        async with self._sessions() as session:
            if after is not None:
                index = await session.scalar(
                    select(BatchItem.item_index).where(
                        BatchItem.batch_id == batch_id, BatchItem.custom_id == after
                    )
                )
                if index is None:
                    return None
                query = query.where(BatchItem.item_index > index)
            rows = (await session.execute(query.limit(limit + 1))).all()
        views = [
            ItemView(
                index=item.item_index,
                custom_id=item.custom_id,
                status=item.status,
                site=site,
                predicted_tokens=item.predicted_tokens,
                assign_reason=item.assign_reason,
                attempts=item.attempts,
                request_id=item.request_id,
                completion=item.completion,
                error=item.error,
            )
            for item, site in rows
        ]
        return _page(views, limit)

    # --- assignment ---

    async def queued(self, batch_id: str, after_index: int, limit: int) -> list[QueuedItem]:
        """Queued items in submission order, whatever their site."""
        return await self._queued(batch_id, after_index, limit)

    async def lane(
        self, batch_id: str, site_id: int | None, after: LaneKey | None, limit: int
    ) -> list[QueuedItem]:
        """Queued items assigned to `site_id` (None: to no site) in the order the batch plan
        stored (plan_rank, ties in submission order), after the item whose lane_key is `after`.
        The order itself is the plan's (gateway/batches/plan.py); the store only keeps it."""
        site = BatchItem.site_id.is_(None) if site_id is None else BatchItem.site_id == site_id
        where = [site]
        if after is not None:
            after_rank, after_index = after
            where.append(
                (BatchItem.plan_rank > after_rank)
                | ((BatchItem.plan_rank == after_rank) & (BatchItem.item_index > after_index))
            )
        return await self._queued(batch_id, -1, limit, *where, order=(BatchItem.plan_rank,))

    async def _queued(
        self,
        batch_id: str,
        after_index: int,
        limit: int,
        *where: Any,
        order: tuple[Any, ...] = (),
    ) -> list[QueuedItem]:
        async with self._sessions() as session:
            rows = await session.scalars(
                select(BatchItem)
                .where(
                    BatchItem.batch_id == batch_id,
                    BatchItem.status == BatchItemStatus.QUEUED,
                    BatchItem.item_index > after_index,
                    *where,
                )
                .order_by(*order, BatchItem.item_index)
                .limit(limit)
            )
            return [queued_item(row) for row in rows]

    async def lanes(self, batch_id: str) -> list[int | None]:
        """The sites (None: no site) that queued items of the batch are assigned to."""
        async with self._sessions() as session:
            rows = await session.scalars(
                select(BatchItem.site_id)
                .where(BatchItem.batch_id == batch_id, BatchItem.status == BatchItemStatus.QUEUED)
                .distinct()
            )
            return list(rows.all())

    async def assign(self, batch_id: str, assignments: Sequence[ItemAssignment]) -> None:
        for start in range(0, len(assignments), _CHUNK):
            async with self._sessions.begin() as session:
                await session.execute(
                    update(BatchItem),
                    [
                        {
                            "batch_id": batch_id,
                            "item_index": a.index,
                            "site_id": a.site_id,
                            "predicted_tokens": a.predicted_tokens,
                            "predicted_bucket": a.predicted_bucket,
                            "predictor_version": a.predictor_version,
                            "assign_reason": a.reason,
                            "plan_rank": a.index if a.rank is None else a.rank,
                        }
                        for a in assignments[start : start + _CHUNK]
                    ],
                )

    async def begin_progress(self, batch_id: str) -> bool:
        """validating -> in_progress; False when the batch is no longer validating (cancelled)."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(BatchJob)
                .where(BatchJob.id == batch_id, BatchJob.status == BatchStatus.VALIDATING)
                .values(status=BatchStatus.IN_PROGRESS, in_progress_at=utcnow())
            )
            return rowcount(result) == 1

    # --- items ---

    async def start_item(self, batch_id: str, index: int, attempts: int, request_id: str) -> bool:
        """Marks the item running as start number attempts + 1; False when it is no longer
        startable (cancelled, final, or started by someone else since `attempts` was read)."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                _as_read(batch_id, index, attempts, BatchItem.status.in_(_NOT_FINAL)).values(
                    status=BatchItemStatus.RUNNING,
                    attempts=attempts + 1,
                    request_id=request_id,
                    started_at=utcnow(),
                )
            )
            return rowcount(result) == 1

    async def finish_item(
        self,
        batch_id: str,
        index: int,
        attempts: int,
        result: ItemResult,
        *,
        started: bool = True,
    ) -> bool:
        """Records the item's final result if it is still running as start number `attempts`
        (with started=False: still queued after `attempts` starts, for an item that fails
        before it can start), counts it in its batch and settles the batch when it was the
        last one. False, changing nothing, otherwise: a runner that lost the item (it was
        queued again, cancelled, or started by another gateway) cannot record it."""
        status = BatchItemStatus.RUNNING if started else BatchItemStatus.QUEUED
        async with self._sessions.begin() as session:
            written = await session.execute(
                _as_read(batch_id, index, attempts, BatchItem.status == status).values(
                    status=result.status,
                    completion=result.completion,
                    error=result.error,
                    status_code=result.status_code,
                    finished_at=utcnow(),
                )
            )
            if rowcount(written) != 1:
                return False
            if started:
                await settle_request_row(session, batch_id, index, result)
            batch = await session.get(
                BatchJob, batch_id, with_for_update=True, populate_existing=True
            )
            if batch is not None:
                if result.status == BatchItemStatus.COMPLETED:
                    batch.completed += 1
                elif result.status == BatchItemStatus.FAILED:
                    batch.failed += 1
                else:
                    batch.cancelled += 1
                settle(batch)
            return True

    async def cancel(self, batch_id: str, owner: Owner) -> BatchView | None:
        """Cancels the owner's batch: the items not started yet at once, the batch marked
        cancelling (its running items are stopped by its runner); a batch already settled or
        cancelling is returned unchanged, one that is not the owner's is None."""
        async with self._sessions.begin() as session:
            marked = await session.execute(
                update(BatchJob)
                .where(
                    BatchJob.id == batch_id,
                    owned_by(BatchJob.api_key_id, owner),
                    BatchJob.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
                )
                .values(status=BatchStatus.CANCELLING, cancelling_at=utcnow())
            )
            cancelled = await cancel_queued(session, batch_id) if rowcount(marked) else 0
            batch = await session.scalar(
                _mine(batch_id, owner).execution_options(populate_existing=True)
            )
            if batch is None:
                return None
            batch.cancelled += cancelled
            settle(batch)
            return batch_view(batch)

    async def cancel_owned_by(self, owner: int) -> list[str]:
        """Cancels every open batch of a key (it was revoked); returns their ids."""
        async with self._sessions() as session:
            ids = list(
                (
                    await session.scalars(
                        select(BatchJob.id).where(
                            BatchJob.api_key_id == owner,
                            BatchJob.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
                        )
                    )
                ).all()
            )
        cancelled = [await self.cancel(batch_id, owner) for batch_id in ids]
        return [view.id for view in cancelled if view is not None]

    async def expire(self, batch_id: str) -> None:
        """Its completion window passed: the items not started are recorded expired at once
        and the batch ends `expired` once its running items are stopped."""
        async with self._sessions.begin() as session:
            await expire_in(session, batch_id)


def _mine(batch_id: str, owner: Owner) -> Select[BatchJob]:
    return select(BatchJob).where(BatchJob.id == batch_id, owned_by(BatchJob.api_key_id, owner))
