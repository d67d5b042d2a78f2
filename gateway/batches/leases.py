"""Which gateway runs which batch: leases in the batches table, and taking over a batch whose
gateway stopped or died.

A gateway runs a batch while it holds its lease (owner, lease_until) and renews it; a batch whose
lease lapsed (its gateway died) or was released (its gateway stopped) is claimed by the next
gateway that looks, which first recovers the items left running. Leases compare the gateways'
clocks, so they must be far longer than the clock skew between gateways.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from sqlalchemy import and_, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.batches.records import BatchView, batch_view
from gateway.batches.settling import OPEN_BATCH, cancel_queued, expire_in, settle
from gateway.db.models import ApiKey, BatchItem, BatchItemStatus, BatchJob, BatchStatus, utcnow
from gateway.db.session import SessionStore
from gateway.stores.pages import rowcount


class BatchLeases(SessionStore):
    async def claim(self, owner: str, lease_s: float, limit: int) -> list[str]:
        """Takes up to `limit` open batches that nobody holds (oldest first); returns their ids."""
        now = utcnow()
        free = or_(BatchJob.owner.is_(None), BatchJob.lease_until < now)
        async with self._sessions() as session:
            candidates = await session.scalars(
                select(BatchJob.id)
                .where(BatchJob.status.in_(OPEN_BATCH), free)
                .order_by(BatchJob.created_at)
                .limit(limit)
            )
            candidate_ids = list(candidates.all())
        claimed = []
        for batch_id in candidate_ids:
            async with self._sessions.begin() as session:
                # Conditional again: another gateway may have claimed it since the select.
                result = await session.execute(
                    update(BatchJob)
                    .where(BatchJob.id == batch_id, BatchJob.status.in_(OPEN_BATCH), free)
                    .values(owner=owner, lease_until=now + timedelta(seconds=lease_s))
                )
                if rowcount(result) == 1:
                    claimed.append(batch_id)
        return claimed

    async def renew(
        self, owner: str, batch_ids: Iterable[str], lease_s: float
    ) -> dict[str, BatchStatus]:
        """Extends the leases still held; returns those batches' statuses (a batch missing from
        the answer settled or was taken over)."""
        ids = list(batch_ids)
        if not ids:
            return {}
        mine = and_(BatchJob.id.in_(ids), BatchJob.owner == owner, BatchJob.status.in_(OPEN_BATCH))
        async with self._sessions.begin() as session:
            await session.execute(
                update(BatchJob)
                .where(mine)
                .values(lease_until=utcnow() + timedelta(seconds=lease_s))
            )
            rows = await session.execute(select(BatchJob.id, BatchJob.status).where(mine))
            return {row.id: row.status for row in rows}

    async def release(self, owner: str, batch_ids: Iterable[str]) -> None:
        ids = list(batch_ids)
        if not ids:
            return
        async with self._sessions.begin() as session:
            await session.execute(
                update(BatchJob)
                .where(BatchJob.id.in_(ids), BatchJob.owner == owner)
                .values(owner=None, lease_until=None)
            )

    async def recover(self, batch_id: str) -> BatchView | None:
        """For a batch just claimed: items left running by the previous owner run again (queued),
        or, if a cancel was asked, are cancelled. A batch whose key was revoked is cancelled and
        one past its completion window expired (the revocation or the window may have come
        while no gateway held it)."""
        async with self._sessions.begin() as session:
            # Writes come first in every transaction here: SQLite then holds its write lock
            # before reading what it will update.
            await session.execute(
                update(BatchItem)
                .where(BatchItem.batch_id == batch_id, BatchItem.status == BatchItemStatus.RUNNING)
                .values(status=BatchItemStatus.QUEUED)
            )
            batch = await session.get(
                BatchJob, batch_id, with_for_update=True, populate_existing=True
            )
            if batch is None:
                return None
            startable = batch.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
            if startable and await self._key_revoked(session, batch.api_key_id):
                batch.status, batch.cancelling_at = BatchStatus.CANCELLING, utcnow()
            if batch.status == BatchStatus.CANCELLING:
                batch.cancelled += await cancel_queued(session, batch_id)
                settle(batch)
            elif startable and batch.expires_at is not None and batch.expires_at <= utcnow():
                await expire_in(session, batch_id)  # reloads and updates this same `batch`
            return batch_view(batch)

    @staticmethod
    async def _key_revoked(session: AsyncSession, key_id: int | None) -> bool:
        if key_id is None:
            return False
        revoked = await session.scalar(select(ApiKey.revoked_at).where(ApiKey.id == key_id))
        return revoked is not None
