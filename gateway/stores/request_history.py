"""SQL behind the admin dashboard's request panels: finished requests and recent totals, the
predictor's drift (predicted vs actual answer tokens) and the offload log. Times are bucketed in
the database like the load series (gateway/stores/load_history.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, literal, select
from sqlalchemy.sql.elements import ColumnElement

from gateway.db.models import InferenceRequest, OffloadEvent, RequestStatus
from gateway.stores.load_history import Sessions, Window
from gateway.stores.sql_time import bucket_index, epoch_seconds


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    request_id: str
    finished_at: datetime
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
        InferenceRequest.id,
        InferenceRequest.finished_at,
        InferenceRequest.site_id,
        epoch_seconds(InferenceRequest.first_token_at) - created,
        epoch_seconds(InferenceRequest.finished_at) - created,
    ).where(_finished_between(since, until, max_age))
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    # The filter requires finished_at, so r[1] is never None here.
    return [FinishedRequest(r[0], r[1] or until, int(r[2] or 0), r[3], float(r[4])) for r in rows]


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
