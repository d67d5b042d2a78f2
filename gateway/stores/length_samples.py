"""Length samples the gateway collected: what retraining the predictor reads."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import LengthSample


@dataclass(frozen=True, slots=True)
class SampleCounts:
    total: int
    censored: int


async def load_samples(
    sessions: async_sessionmaker[AsyncSession],
    *,
    model: str | None = None,
    include_censored: bool = False,
    limit: int | None = None,
) -> list[tuple[str, int]]:
    """(prompt, completion tokens), newest first. Censored samples (cut at max_tokens) only say
    the answer was at least that long, so by default they are left out."""
    query = select(LengthSample.prompt, LengthSample.completion_tokens).order_by(
        LengthSample.created_at.desc(), LengthSample.id.desc()
    )
    if model is not None:
        query = query.where(LengthSample.model == model)
    if not include_censored:
        query = query.where(LengthSample.censored.is_(False))
    if limit is not None:
        query = query.limit(limit)
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    return [(prompt, int(tokens)) for prompt, tokens in rows]


async def count_samples(
    sessions: async_sessionmaker[AsyncSession], model: str | None = None
) -> SampleCounts:
    query = select(
        func.count(LengthSample.id),
        func.count(LengthSample.id).filter(LengthSample.censored.is_(True)),
    )
    if model is not None:
        query = query.where(LengthSample.model == model)
    async with sessions() as session:
        total, censored = (await session.execute(query)).one()
    return SampleCounts(int(total), int(censored))
