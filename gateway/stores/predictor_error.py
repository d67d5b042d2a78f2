"""What the predictor predicted and what the served model then answered, per model: the rows
the rolling error (gateway/prediction/drift.py) is computed from.

A window is one model's newest length samples that carry a prediction, all from the predictor
version that predicted its newest one (the version serving it now): after a new version is
activated, its window starts afresh, so its error is never mixed with its predecessor's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import InferenceRequest, LengthSample


@dataclass(frozen=True, slots=True)
class ServedWindow:
    model: str
    version: str
    # (predicted expected tokens, true completion tokens), newest first.
    pairs: list[tuple[int, int]]
    newest_at: datetime


async def served_windows(
    sessions: async_sessionmaker[AsyncSession],
    *,
    window_samples: int,
    since: datetime | None,
    include_censored: bool,
) -> dict[str, ServedWindow]:
    """Each model's window: its newest `window_samples` samples (since `since`) of the version
    that predicted its newest sample."""
    s, r = LengthSample, InferenceRequest
    where: list[ColumnElement[bool]] = [
        s.predicted_tokens.is_not(None),
        r.predictor_version.is_not(None),
    ]
    if since is not None:
        where.append(s.created_at >= since)
    if not include_censored:
        where.append(s.censored.is_(False))
    partition = (s.model, r.predictor_version)
    numbered = (
        select(
            s.model,
            r.predictor_version.label("version"),
            s.predicted_tokens,
            s.completion_tokens,
            s.created_at,
            func.row_number()
            .over(partition_by=partition, order_by=(s.created_at.desc(), s.id.desc()))
            .label("n"),
        )
        .join(r, r.id == s.request_id)
        .where(*where)
        .subquery()
    )
    query = (
        select(
            numbered.c.model,
            numbered.c.version,
            numbered.c.predicted_tokens,
            numbered.c.completion_tokens,
            numbered.c.created_at,
        )
        .where(numbered.c.n <= window_samples)
        .order_by(numbered.c.model, numbered.c.version, numbered.c.n)
    )
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    by_version: dict[tuple[str, str], ServedWindow] = {}
    for model, version, predicted, served, at in rows:
        window = by_version.get((model, version))
        if window is None:  # rows come newest first within each (model, version)
            window = by_version[(model, version)] = ServedWindow(model, version, [], at)
        window.pairs.append((int(predicted), int(served)))
    current: dict[str, ServedWindow] = {}
    for window in by_version.values():
        best = current.get(window.model)
        if best is None or window.newest_at > best.newest_at:
            current[window.model] = window
    return current
