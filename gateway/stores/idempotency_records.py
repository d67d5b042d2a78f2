"""SQL of Idempotency-Key records (gateway/idempotency.py decides what they mean)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.exc import IntegrityError

from gateway.db.models import IdempotencyRecord, IdempotencyStatus, utcnow
from gateway.db.session import SessionStore


@dataclass(frozen=True, slots=True)
class StoredKey:
    request_hash: str
    status: IdempotencyStatus
    response_status: int | None
    response_body: bytes | None
    created_at: datetime


class IdempotencyStore(SessionStore):
    async def claim(
        self, scope: str, key: str, request_hash: str, ttl_s: float, abandoned_after_s: float
    ) -> StoredKey | None:
        """Records the key as running for this request and returns None; or, when the key is
        already recorded (and neither expired nor abandoned), returns that record unchanged.

        An expired record, or a running one older than `abandoned_after_s` (its gateway died
        while serving it), is replaced: the request runs again."""
        now = utcnow()
        for _ in range(2):  # a record deleted between the insert and the select: once more
            async with self._sessions.begin() as session:
                await session.execute(
                    delete(IdempotencyRecord).where(
                        IdempotencyRecord.scope == scope,
                        IdempotencyRecord.key == key,
                        or_(
                            IdempotencyRecord.expires_at <= now,
                            and_(
                                IdempotencyRecord.status == IdempotencyStatus.RUNNING,
                                IdempotencyRecord.created_at
                                <= now - timedelta(seconds=abandoned_after_s),
                            ),
                        ),
                    )
                )
            try:
                async with self._sessions.begin() as session:
                    session.add(
                        IdempotencyRecord(
                            scope=scope,
                            key=key,
                            request_hash=request_hash,
                            status=IdempotencyStatus.RUNNING,
                            created_at=now,
                            expires_at=now + timedelta(seconds=ttl_s),
                        )
                    )
                return None
            except IntegrityError:
                pass  # the key is taken: report what holds it
            async with self._sessions() as session:
                row = await session.scalar(
                    select(IdempotencyRecord).where(
                        IdempotencyRecord.scope == scope, IdempotencyRecord.key == key
                    )
                )
                if row is not None:
                    return StoredKey(
                        row.request_hash,
                        row.status,
                        row.response_status,
                        row.response_body,
                        row.created_at,
                    )
        raise RuntimeError(f"idempotency key {key!r} could be neither claimed nor read")

    async def complete(self, scope: str, key: str, status: int, body: bytes) -> None:
        async with self._sessions.begin() as session:
            await session.execute(
                update(IdempotencyRecord)
                .where(IdempotencyRecord.scope == scope, IdempotencyRecord.key == key)
                .values(
                    status=IdempotencyStatus.COMPLETED, response_status=status, response_body=body
                )
            )

    async def release(self, scope: str, key: str) -> None:
        """Forgets a running key (its request failed), so a retry runs the request again."""
        async with self._sessions.begin() as session:
            await session.execute(
                delete(IdempotencyRecord).where(
                    IdempotencyRecord.scope == scope,
                    IdempotencyRecord.key == key,
                    IdempotencyRecord.status == IdempotencyStatus.RUNNING,
                )
            )

    async def purge_expired(self) -> int:
        async with self._sessions.begin() as session:
            result = await session.execute(
                delete(IdempotencyRecord).where(IdempotencyRecord.expires_at <= utcnow())
            )
        return int(getattr(result, "rowcount", 0) or 0)
