"""SQL of the scaling events (gateway/db/models/scaling.py): written as they happen, read by the
dashboard's capacity panel and the admin API."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import ScalingEvent

Sessions = async_sessionmaker[AsyncSession]


@dataclass(frozen=True, slots=True)
class NewScalingEvent:
    model: str
    action: str  # scale_out, scale_in, start_failed, join, leave
    actor: str  # controller, operator, or the actuator's name
    serving_sites: int
    desired_sites: int
    reason: str
    site: str | None = None
    backlog_s: float | None = None
    forecast_backlog_s: float | None = None
    arrival_rate: float | None = None
    lead_s: float | None = None
    smoothed_backlog_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalingEventRow(NewScalingEvent):
    """A recorded event: what was written, and when."""

    at: datetime


# The event's fields, each a column of the same name: written and read by name, so a new field
# is one line of NewScalingEvent (and the table's column).
_FIELDS = tuple(field.name for field in fields(NewScalingEvent))


async def record_scaling_event(sessions: Sessions, event: NewScalingEvent) -> None:
    values = {name: getattr(event, name) for name in _FIELDS}
    async with sessions.begin() as session:
        session.add(ScalingEvent(**values | {"reason": event.reason[:256]}))


async def scaling_events_since(
    sessions: Sessions, since: datetime, limit: int, model: str | None = None
) -> list[ScalingEventRow]:
    """The latest `limit` events since `since`, newest first."""
    query = select(ScalingEvent).where(ScalingEvent.created_at >= since)
    if model is not None:
        query = query.where(ScalingEvent.model == model)
    query = query.order_by(ScalingEvent.created_at.desc(), ScalingEvent.id.desc()).limit(limit)
    async with sessions() as session:
        rows = (await session.scalars(query)).all()
    return [
        ScalingEventRow(at=row.created_at, **{name: getattr(row, name) for name in _FIELDS})
        for row in rows
    ]
