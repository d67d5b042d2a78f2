"""SQL behind the admin dashboard: load samples in and out, and aggregates over requests.

Time series are downsampled in the database: rows are grouped into buckets of the requested step
(`bucket_index`), so a day of 9 sites sampled every 10 s (~78k rows) leaves the database as a few
thousand aggregates. Timestamp arithmetic differs per backend: see sql_time.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import case, delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.sql.elements import ColumnElement

from gateway.db.models import (
    LoadRollup,
    LoadSample,
    Site,
)
from gateway.stores.sql_time import bucket_index


@dataclass(frozen=True, slots=True)
class Window:
    """`points` buckets of `step_s` seconds from `start_s` (epoch seconds)."""

    start_s: int
    step_s: int
    points: int

    @property
    def start(self) -> datetime:
        return datetime.fromtimestamp(self.start_s, UTC)

    @property
    def end(self) -> datetime:
        return datetime.fromtimestamp(self.start_s + self.step_s * self.points, UTC)


@dataclass(frozen=True, slots=True)
class NewLoadSample:
    site_id: int
    queued_tokens: int
    running_tokens: int
    predicted_remaining_tokens: int
    queued_requests: int
    running_requests: int
    completed_requests: int
    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    e2e_mean_ms: float | None
    e2e_p50_ms: float | None
    healthy: bool


@dataclass(frozen=True, slots=True)
class SiteRef:
    site_id: int
    name: str
    cloud: str
    region: str
    model: str


@dataclass(frozen=True, slots=True)
class SiteBucket:
    """One site's samples in one bucket, as sums (so raw samples and rollups add up exactly)."""

    site_id: int
    index: int
    samples: int
    queued_tokens_sum: float
    running_tokens_sum: float
    predicted_remaining_tokens_sum: float
    queued_requests_sum: float
    running_requests_sum: float
    completed_requests: int
    # Per-sample latency means weighted by their completions, and those completions.
    ttft_ms_weighted: float
    ttft_weight: int
    e2e_ms_weighted: float
    e2e_weight: int
    healthy_samples: int

    def __add__(self, other: SiteBucket) -> SiteBucket:
        sums = [a + b for a, b in zip(_sums(self), _sums(other), strict=True)]
        return _from_sums(self.site_id, self.index, sums)


def _from_sums(site_id: int, index: int, sums: Sequence[Any]) -> SiteBucket:
    """A bucket from its sums in _ROLLUP_FIELDS order (SQL rows or added buckets)."""
    s = list(sums)
    return SiteBucket(
        site_id=site_id,
        index=index,
        samples=int(s[0]),
        queued_tokens_sum=float(s[1]),
        running_tokens_sum=float(s[2]),
        predicted_remaining_tokens_sum=float(s[3]),
        queued_requests_sum=float(s[4]),
        running_requests_sum=float(s[5]),
        completed_requests=int(s[6]),
        ttft_ms_weighted=float(s[7]),
        ttft_weight=int(s[8]),
        e2e_ms_weighted=float(s[9]),
        e2e_weight=int(s[10]),
        healthy_samples=int(s[11]),
    )


def _sums(bucket: SiteBucket) -> tuple[float, ...]:
    return (
        bucket.samples,
        bucket.queued_tokens_sum,
        bucket.running_tokens_sum,
        bucket.predicted_remaining_tokens_sum,
        bucket.queued_requests_sum,
        bucket.running_requests_sum,
        bucket.completed_requests,
        bucket.ttft_ms_weighted,
        bucket.ttft_weight,
        bucket.e2e_ms_weighted,
        bucket.e2e_weight,
        bucket.healthy_samples,
    )


Sessions = async_sessionmaker[AsyncSession]


async def site_directory(sessions: Sessions) -> dict[int, SiteRef]:
    async with sessions() as session:
        rows = (
            await session.execute(select(Site.id, Site.name, Site.cloud, Site.region, Site.model))
        ).all()
    return {row[0]: SiteRef(*row) for row in rows}


async def write_samples(sessions: Sessions, at: datetime, samples: Sequence[NewLoadSample]) -> None:
    if not samples:
        return
    rows = [
        {
            "bucket_at": at,
            "site_id": s.site_id,
            "queued_tokens": s.queued_tokens,
            "running_tokens": s.running_tokens,
            "predicted_remaining_tokens": s.predicted_remaining_tokens,
            "queued_requests": s.queued_requests,
            "running_requests": s.running_requests,
            "completed_requests": s.completed_requests,
            "ttft_mean_ms": s.ttft_mean_ms,
            "ttft_p50_ms": s.ttft_p50_ms,
            "e2e_mean_ms": s.e2e_mean_ms,
            "e2e_p50_ms": s.e2e_p50_ms,
            "healthy": s.healthy,
        }
        for s in samples
    ]
    async with sessions.begin() as session:
        await session.execute(insert(LoadSample), rows)


async def delete_samples_before(sessions: Sessions, cutoff: datetime) -> int:
    """Retention: drops samples and rollups older than `cutoff`; returns samples dropped."""
    async with sessions.begin() as session:
        result = await session.execute(delete(LoadSample).where(LoadSample.bucket_at < cutoff))
        await session.execute(delete(LoadRollup).where(LoadRollup.period_at < cutoff))
    return int(getattr(result, "rowcount", 0) or 0)


ROLLUP_S = 300  # rollup period; a history step that is a multiple of it reads rollups


def _raw_sums() -> list[ColumnElement[Any]]:
    completed = LoadSample.completed_requests
    return [
        func.count(),
        func.sum(LoadSample.queued_tokens),
        func.sum(LoadSample.running_tokens),
        func.sum(LoadSample.predicted_remaining_tokens),
        func.sum(LoadSample.queued_requests),
        func.sum(LoadSample.running_requests),
        func.sum(completed),
        func.coalesce(func.sum(LoadSample.ttft_mean_ms * completed), 0.0),
        func.sum(case((LoadSample.ttft_mean_ms.is_not(None), completed), else_=0)),
        func.coalesce(func.sum(LoadSample.e2e_mean_ms * completed), 0.0),
        func.sum(case((LoadSample.e2e_mean_ms.is_not(None), completed), else_=0)),
        func.sum(case((LoadSample.healthy, 1), else_=0)),
    ]


def _rollup_sums() -> list[ColumnElement[Any]]:
    r = LoadRollup
    columns = (
        r.samples, r.queued_tokens_sum, r.running_tokens_sum, r.predicted_remaining_tokens_sum,
        r.queued_requests_sum, r.running_requests_sum, r.completed_requests, r.ttft_ms_weighted,
        r.ttft_weight, r.e2e_ms_weighted, r.e2e_weight, r.healthy_samples,
    )  # fmt: skip
    return [func.sum(c) for c in columns]


def _bucket(row: Any) -> SiteBucket:
    return _from_sums(int(row[0]), int(row[1]), row[2:])


async def rolled_until(sessions: Sessions) -> datetime | None:
    """The end of the last rolled-up period (None: nothing rolled up yet)."""
    async with sessions() as session:
        last = await session.scalar(select(func.max(LoadRollup.period_at)))
    return None if last is None else last + timedelta(seconds=ROLLUP_S)


async def oldest_history(sessions: Sessions) -> datetime | None:
    """When the oldest history kept begins (a rollup's period or a sample; None: none)."""
    async with sessions() as session:
        rolled = await session.scalar(select(func.min(LoadRollup.period_at)))
        sampled = await session.scalar(select(func.min(LoadSample.bucket_at)))
    found = [at for at in (rolled, sampled) if at is not None]
    return min(found) if found else None


async def roll_up(sessions: Sessions, until: datetime) -> int:
    """Sums the samples of every period after the last rolled-up one and ending by `until`
    into load_rollups (one INSERT ... SELECT); returns how many rows it wrote."""
    end_s = math.floor(until.timestamp() / ROLLUP_S) * ROLLUP_S
    done = await rolled_until(sessions)
    async with sessions.begin() as session:
        if done is None:
            first = await session.scalar(select(func.min(LoadSample.bucket_at)))
            if first is None:
                return 0
            done = datetime.fromtimestamp(first.timestamp() // ROLLUP_S * ROLLUP_S, UTC)
        end = datetime.fromtimestamp(end_s, UTC)
        if end <= done:
            return 0
        index = bucket_index(LoadSample.bucket_at, int(done.timestamp()), ROLLUP_S)
        rows = (
            await session.execute(
                select(LoadSample.site_id, index, *_raw_sums())
                .where(LoadSample.bucket_at >= done, LoadSample.bucket_at < end)
                .group_by(LoadSample.site_id, index)
            )
        ).all()
        values = [
            {
                "site_id": b.site_id,
                "period_at": done + timedelta(seconds=b.index * ROLLUP_S),
                **dict(zip(_ROLLUP_FIELDS, _sums(b), strict=True)),
            }
            for b in map(_bucket, rows)
        ]
        if values:
            await session.execute(insert(LoadRollup), values)
    return len(values)


_ROLLUP_FIELDS = (
    "samples", "queued_tokens_sum", "running_tokens_sum", "predicted_remaining_tokens_sum",
    "queued_requests_sum", "running_requests_sum", "completed_requests", "ttft_ms_weighted",
    "ttft_weight", "e2e_ms_weighted", "e2e_weight", "healthy_samples",
)  # fmt: skip


async def load_buckets(
    sessions: Sessions, window: Window, site_id: int | None = None
) -> list[SiteBucket]:
    """Per site and bucket of the window, downsampled in SQL: from the 5-minute rollups where
    the step allows and they exist, from the raw samples for the rest."""
    raw_from = window.start
    queries = []
    done = await rolled_until(sessions) if window.step_s % ROLLUP_S == 0 else None
    if done is not None and done > window.start and window.start_s % ROLLUP_S == 0:
        raw_from = min(done, window.end)
        index = bucket_index(LoadRollup.period_at, window.start_s, window.step_s)
        query = (
            select(LoadRollup.site_id, index, *_rollup_sums())
            .where(LoadRollup.period_at >= window.start, LoadRollup.period_at < raw_from)
            .group_by(LoadRollup.site_id, index)
        )
        if site_id is not None:
            query = query.where(LoadRollup.site_id == site_id)
        queries.append(query)
    index = bucket_index(LoadSample.bucket_at, window.start_s, window.step_s)
    query = (
        select(LoadSample.site_id, index, *_raw_sums())
        .where(LoadSample.bucket_at >= raw_from, LoadSample.bucket_at < window.end)
        .group_by(LoadSample.site_id, index)
    )
    if site_id is not None:
        query = query.where(LoadSample.site_id == site_id)
    queries.append(query)
    merged: dict[tuple[int, int], SiteBucket] = {}
    async with sessions() as session:
        for q in queries:
            for row in (await session.execute(q)).all():
                b = _bucket(row)
                key = (b.site_id, b.index)
                merged[key] = merged[key] + b if key in merged else b
    return list(merged.values())
