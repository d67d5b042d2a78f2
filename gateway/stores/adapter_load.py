"""SQL behind the dashboard's per-adapter load line: the requests each LoRA adapter served over
the dashboard's window, from the request rows (their `adapter`, migration 0020)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select

from gateway.db.models import InferenceRequest
from gateway.stores.load_history import Sessions


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    model: str  # the base model the adapter applies to
    adapter: str
    requests: int
    prompt_tokens: int
    completion_tokens: int  # of those that have answered so far


async def adapter_load(sessions: Sessions, since: datetime) -> list[AdapterLoad]:
    """Each adapter's requests made since `since`, busiest first (base-model requests left out:
    the overview's per-site load already shows them)."""
    requests = func.count()
    query = (
        select(
            InferenceRequest.model,
            InferenceRequest.adapter,
            requests,
            func.coalesce(func.sum(InferenceRequest.prompt_tokens), 0),
            func.coalesce(func.sum(InferenceRequest.completion_tokens), 0),
        )
        .where(InferenceRequest.created_at >= since, InferenceRequest.adapter.is_not(None))
        .group_by(InferenceRequest.model, InferenceRequest.adapter)
        .order_by(requests.desc(), InferenceRequest.model, InferenceRequest.adapter)
    )
    async with sessions() as session:
        rows = (await session.execute(query)).all()
    # The query's filter leaves no null adapter, and coalesce no null sum.
    return [AdapterLoad(r[0], r[1] or "", int(r[2]), int(r[3] or 0), int(r[4] or 0)) for r in rows]
