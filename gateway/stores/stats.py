"""Aggregates over recorded requests."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import InferenceRequest, RequestStatus, Site


@dataclass(frozen=True, slots=True)
class SiteTotals:
    site: str
    cloud: str
    region: str
    requests: int
    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    predicted_tokens: int = 0


async def site_totals(sessions: async_sessionmaker[AsyncSession]) -> list[SiteTotals]:
    """Per site: requests assigned, how they ended, and prompt/completion tokens served."""
    completed = func.sum(case((InferenceRequest.status == RequestStatus.COMPLETED, 1), else_=0))
    failed = func.sum(case((InferenceRequest.status == RequestStatus.FAILED, 1), else_=0))
    query = (
        select(
            Site.name,
            Site.cloud,
            Site.region,
            func.count(InferenceRequest.id),
            func.coalesce(completed, 0),
            func.coalesce(failed, 0),
            func.coalesce(func.sum(InferenceRequest.prompt_tokens), 0),
            func.coalesce(func.sum(InferenceRequest.completion_tokens), 0),
            func.coalesce(func.sum(InferenceRequest.predicted_tokens), 0),
        )
        .select_from(Site)
        .outerjoin(InferenceRequest, InferenceRequest.site_id == Site.id)
        .where(Site.enabled.is_(True))
        .group_by(Site.id, Site.name, Site.cloud, Site.region)
        .order_by(Site.cloud, Site.region, Site.name)
    )
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    return [SiteTotals(*(row[:3]), *(int(v) for v in row[3:])) for row in rows]


@dataclass(frozen=True, slots=True)
class PredictionPair:
    site: str
    predicted_tokens: int
    completion_tokens: int
    request_id: str = ""


async def prediction_pairs(sessions: async_sessionmaker[AsyncSession]) -> list[PredictionPair]:
    """Completed requests that carried a length prediction: predicted vs actual answer tokens."""
    query = (
        select(
            Site.name,
            InferenceRequest.predicted_tokens,
            InferenceRequest.completion_tokens,
            InferenceRequest.id,
        )
        .join(Site, InferenceRequest.site_id == Site.id)
        .where(
            InferenceRequest.status == RequestStatus.COMPLETED,
            InferenceRequest.predicted_tokens.is_not(None),
            InferenceRequest.completion_tokens.is_not(None),
        )
        .order_by(InferenceRequest.created_at)
    )
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    return [
        PredictionPair(name, predicted, actual, request_id)
        for name, predicted, actual, request_id in rows
        if predicted is not None and actual is not None  # the query's filter, for the types
    ]
