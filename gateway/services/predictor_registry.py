"""Registered predictor versions: which artifact the gateways should serve."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import PredictorVersion, utcnow


@dataclass(frozen=True, slots=True)
class RegisteredVersion:
    version: str
    path: str
    kind: str
    scheme: str
    active: bool


def _view(row: PredictorVersion) -> RegisteredVersion:
    return RegisteredVersion(row.version, row.path, row.kind, row.scheme, row.active)


class PredictorRegistry:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    async def register(
        self,
        *,
        version: str,
        path: str,
        kind: str,
        scheme: str,
        metrics: dict[str, object],
        activate: bool,
    ) -> RegisteredVersion:
        """Adds a version (or refreshes its path and metrics); with activate, it alone is active."""
        async with self._sessions.begin() as session:
            row = await session.scalar(
                select(PredictorVersion).where(PredictorVersion.version == version)
            )
            if row is None:
                row = PredictorVersion(version=version, active=False)
                session.add(row)
            row.path, row.kind, row.scheme, row.metrics = path, kind, scheme, metrics
            if activate:
                await session.execute(update(PredictorVersion).values(active=False))
                row.active, row.activated_at = True, utcnow()
            await session.flush()
            return _view(row)

    async def active(self) -> RegisteredVersion | None:
        async with self._sessions() as session:
            row = await session.scalar(
                select(PredictorVersion).where(PredictorVersion.active.is_(True))
            )
        return _view(row) if row is not None else None

    async def all(self) -> list[RegisteredVersion]:
        async with self._sessions() as session:
            rows = await session.scalars(
                select(PredictorVersion).order_by(PredictorVersion.created_at)
            )
            return [_view(row) for row in rows]
