"""SQL of the scaling events (gateway/db/models/scaling.py): written as they happen, read by the
dashboard's capacity panel and the admin API."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class ScalingEventRow:
    at: datetime
    model: str
    action: str
    actor: str
    site: str | None
    serving_sites: int
    desired_sites: int
    backlog_s: float | None
    forecast_backlog_s: float | None
    reason: str
    arrival_rate: float | None = None
    lead_s: float | None = None
    smoothed_backlog_s: float | None = None


async def record_scaling_event(sessions: Sessions, event: NewScalingEvent) -> None:
    async with sessions.begin() as session:
        session.add(
            ScalingEvent(
                model=event.model,
                action=event.action,
                actor=event.actor,
                site=event.site,
                serving_sites=event.serving_sites,
                desired_sites=event.desired_sites,
                backlog_s=event.backlog_s,
                forecast_backlog_s=event.forecast_backlog_s,
                arrival_rate=event.arrival_rate,
                lead_s=event.lead_s,
                smoothed_backlog_s=event.smoothed_backlog_s,
                reason=event.reason[:256],
            )
        )


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
        ScalingEventRow(
            at=row.created_at,
            model=row.model,
            action=row.action,
            actor=row.actor,
            site=row.site,
            serving_sites=row.serving_sites,
            desired_sites=row.desired_sites,
            backlog_s=row.backlog_s,
            forecast_backlog_s=row.forecast_backlog_s,
            reason=row.reason,
            arrival_rate=row.arrival_rate,
            lead_s=row.lead_s,
            smoothed_backlog_s=row.smoothed_backlog_s,
        )
        for row in rows
    ]
