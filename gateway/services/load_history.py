"""SQL behind the admin dashboard: load samples in and out, and aggregates over requests.

Time series are downsampled in the database: rows are grouped into buckets of the requested step
(`bucket_index`), so a day of 9 sites sampled every 10 s (~78k rows) leaves the database as a few
thousand aggregates. Timestamp arithmetic differs per backend, hence the compiled elements below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Float, Integer, case, delete, func, insert, literal, select
from sqlalchemy.exc import CompileError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from gateway.db.models import (
    InferenceRequest,
    LoadRollup,
    LoadSample,
    OffloadEvent,
    RequestStatus,
    Site,
)


class epoch_seconds(FunctionElement[float]):  # noqa: N801 - reads as a SQL function
    """Seconds since 1970 of a UTC timestamp column."""

    type = Float()
    inherit_cache = True
    name = "epoch_seconds"


@compiles(epoch_seconds, "postgresql")
def _epoch_postgres(element: epoch_seconds, compiler: SQLCompiler, **kw: Any) -> str:
    return f"CAST(EXTRACT(EPOCH FROM {compiler.process(element.clauses, **kw)}) AS FLOAT)"


def _sqlite_epoch(column: str) -> str:
    # SQLAlchemy stores SQLite datetimes as UTC text, which julianday() parses; julianday is a
    # double, so round to milliseconds: 12:01:00 must not come back as 12:00:59.9999998.
    return f"ROUND((julianday({column}) - 2440587.5) * 86400.0, 3)"


@compiles(epoch_seconds, "sqlite")
def _epoch_sqlite(element: epoch_seconds, compiler: SQLCompiler, **kw: Any) -> str:
    return _sqlite_epoch(compiler.process(element.clauses, **kw))


@compiles(epoch_seconds)
def _epoch_other(element: epoch_seconds, compiler: SQLCompiler, **kw: Any) -> str:
    raise CompileError(f"epoch_seconds is not defined for {compiler.dialect.name}")


class bucket_index(FunctionElement[int]):  # noqa: N801 - reads as a SQL function
    """floor((epoch_seconds(column) - start) / step) for rows at or after `start`."""

    type = Integer()
    inherit_cache = True
    name = "bucket_index"


@compiles(bucket_index, "postgresql")
def _bucket_postgres(element: bucket_index, compiler: SQLCompiler, **kw: Any) -> str:
    column, start, step = (compiler.process(c, **kw) for c in element.clauses)
    return f"CAST(FLOOR((EXTRACT(EPOCH FROM {column}) - {start}) / {step}) AS INTEGER)"


@compiles(bucket_index, "sqlite")
def _bucket_sqlite(element: bucket_index, compiler: SQLCompiler, **kw: Any) -> str:
    column, start, step = (compiler.process(c, **kw) for c in element.clauses)
    # CAST truncates; rows are filtered to >= start, so truncation is floor.
    return f"CAST(({_sqlite_epoch(column)} - {start}) / {step} AS INTEGER)"


@compiles(bucket_index)
def _bucket_other(element: bucket_index, compiler: SQLCompiler, **kw: Any) -> str:
    raise CompileError(f"bucket_index is not defined for {compiler.dialect.name}")


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


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    site_id: int
    ttft_s: float | None
    e2e_s: float


@dataclass(frozen=True, slots=True)
class RecentStats:
    completed: int
    ttft_s_sum: float
    ttft_count: int
    e2e_s_sum: float


@dataclass(frozen=True, slots=True)
class DriftBucket:
    site_id: int
    model: str
    index: int
    count: int
    predicted_sum: int
    actual_sum: int
    error_sum: int  # predicted - actual
    abs_error_sum: int


@dataclass(frozen=True, slots=True)
class OffloadRow:
    at: datetime
    request_id: str
    from_site_id: int | None
    to_site_id: int | None


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


def _finished_between(since: datetime, until: datetime, max_age: timedelta) -> ColumnElement[bool]:
    # created_at bounds the scan through its index; no request outlives max_age.
    return (
        (InferenceRequest.status == RequestStatus.COMPLETED)
        & (InferenceRequest.site_id.is_not(None))
        & (InferenceRequest.created_at >= since - max_age)
        & (InferenceRequest.finished_at > since)
        & (InferenceRequest.finished_at <= until)
    )


async def finished_requests(
    sessions: Sessions, since: datetime, until: datetime, max_age: timedelta
) -> list[FinishedRequest]:
    """Completed requests that finished in (since, until], with their latencies in seconds."""
    created = epoch_seconds(InferenceRequest.created_at)
    query = select(
        InferenceRequest.site_id,
        epoch_seconds(InferenceRequest.first_token_at) - created,
        epoch_seconds(InferenceRequest.finished_at) - created,
    ).where(_finished_between(since, until, max_age))
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    return [FinishedRequest(int(r[0] or 0), r[1], float(r[2])) for r in rows]


async def recent_stats(
    sessions: Sessions, since: datetime, until: datetime, max_age: timedelta
) -> dict[int, RecentStats]:
    """Per site: completions in (since, until] and their latency sums (seconds)."""
    created = epoch_seconds(InferenceRequest.created_at)
    ttft = epoch_seconds(InferenceRequest.first_token_at) - created
    query = (
        select(
            InferenceRequest.site_id,
            func.count(),
            func.coalesce(func.sum(ttft), 0.0),
            func.count(InferenceRequest.first_token_at),
            func.coalesce(func.sum(epoch_seconds(InferenceRequest.finished_at) - created), 0.0),
        )
        .where(_finished_between(since, until, max_age))
        .group_by(InferenceRequest.site_id)
    )
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    return {
        int(r[0] or 0): RecentStats(int(r[1]), float(r[2]), int(r[3]), float(r[4])) for r in rows
    }


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


async def drift_buckets(
    sessions: Sessions, window: Window, site_id: int | None = None, *, bucketed: bool = True
) -> list[DriftBucket]:
    """Predicted vs actual completion tokens of completed, predicted requests, per site, model
    and bucket of their creation time (bucketed=False: one bucket, index 0, for the window).
    Answers cut at max_tokens count with their cut length."""
    r = InferenceRequest
    error = r.predicted_tokens - r.completion_tokens
    index = (
        bucket_index(r.created_at, window.start_s, window.step_s) if bucketed else literal(0)
    ).label("idx")
    keys: list[Any] = [r.site_id, r.model, index] if bucketed else [r.site_id, r.model]
    query = (
        select(
            r.site_id,
            r.model,
            index,
            func.count(),
            func.sum(r.predicted_tokens),
            func.sum(r.completion_tokens),
            func.sum(error),
            func.sum(func.abs(error)),
        )
        .where(
            r.status == RequestStatus.COMPLETED,
            r.site_id.is_not(None),
            r.predicted_tokens.is_not(None),
            r.completion_tokens.is_not(None),
            r.created_at >= window.start,
            r.created_at < window.end,
        )
        .group_by(*keys)
    )
    if site_id is not None:
        query = query.where(r.site_id == site_id)
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    return [DriftBucket(int(x[0]), x[1], *(int(v) for v in x[2:])) for x in rows]


async def offloads_since(
    sessions: Sessions, since: datetime, limit: int, site_id: int | None = None
) -> tuple[int, list[OffloadRow]]:
    """How many offloads happened since `since`, and the latest `limit` of them."""
    where = [OffloadEvent.created_at >= since]
    if site_id is not None:
        where.append((OffloadEvent.from_site_id == site_id) | (OffloadEvent.to_site_id == site_id))
    latest = (
        select(
            OffloadEvent.created_at,
            OffloadEvent.request_id,
            OffloadEvent.from_site_id,
            OffloadEvent.to_site_id,
        )
        .where(*where)
        .order_by(OffloadEvent.created_at.desc(), OffloadEvent.id.desc())
        .limit(limit)
    )
    async with sessions() as session:
        total = (
            await session.execute(select(func.count()).select_from(OffloadEvent).where(*where))
        ).scalar_one()
        rows = (await session.execute(latest)).all()
    return int(total), [OffloadRow(*row) for row in rows]
