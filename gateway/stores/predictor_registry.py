"""Registered predictor versions: which artifact the gateways serve for each model.

A version belongs to one served model ("" is the default: it predicts every model without a
version of its own). At most one version per model is active.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, update

from gateway.db.models import PredictorVersion, utcnow
from gateway.db.session import SessionStore

DEFAULT_MODEL = ""


@dataclass(frozen=True, slots=True)
class RegisteredVersion:
    version: str
    path: str
    kind: str
    scheme: str
    active: bool
    model: str = DEFAULT_MODEL


def _view(row: PredictorVersion) -> RegisteredVersion:
    return RegisteredVersion(row.version, row.path, row.kind, row.scheme, row.active, row.model)


class PredictorRegistry(SessionStore):
    async def register(
        self,
        *,
        version: str,
        path: str,
        kind: str,
        scheme: str,
        metrics: dict[str, object],
        activate: bool,
        model: str = DEFAULT_MODEL,
    ) -> RegisteredVersion:
        """Adds a version (or refreshes its path and metrics); with activate, it alone is active
        for its model."""
        async with self._sessions.begin() as session:
            row = await session.scalar(
                select(PredictorVersion).where(PredictorVersion.version == version)
            )
            if row is None:
                row = PredictorVersion(version=version, active=False, model=model)
                session.add(row)
            elif row.model != model:
                raise ValueError(
                    f"predictor version {version} is registered for model {row.model!r}, "
                    f"not {model!r}"
                )
            row.path, row.kind, row.scheme, row.metrics = path, kind, scheme, metrics
            if activate:
                await session.execute(
                    update(PredictorVersion)
                    .where(PredictorVersion.model == model)
                    .values(active=False)
                )
                row.active, row.activated_at = True, utcnow()
            await session.flush()
            return _view(row)

    async def active(self, model: str = DEFAULT_MODEL) -> RegisteredVersion | None:
        """The model's own active version (not the default's: see `active_by_model`)."""
        async with self._sessions() as session:
            row = await session.scalar(
                select(PredictorVersion).where(
                    PredictorVersion.active.is_(True), PredictorVersion.model == model
                )
            )
        return _view(row) if row is not None else None

    async def active_by_model(self) -> dict[str, RegisteredVersion]:
        async with self._sessions() as session:
            rows = await session.scalars(
                select(PredictorVersion).where(PredictorVersion.active.is_(True))
            )
            return {row.model: _view(row) for row in rows}

    async def all(self) -> list[RegisteredVersion]:
        async with self._sessions() as session:
            rows = await session.scalars(
                select(PredictorVersion).order_by(PredictorVersion.created_at)
            )
            return [_view(row) for row in rows]

    async def metrics_of(self, version: str) -> dict[str, object] | None:
        async with self._sessions() as session:
            row = await session.scalar(
                select(PredictorVersion).where(PredictorVersion.version == version)
            )
        return dict(row.metrics) if row is not None else None
