"""The aggregate reads over a batch's items: the tokens its answers took (OpenAI's `usage`) and
the work its plan expects, done and all (the `progress` extension, gateway/batches/progress.py).
BatchStore runs them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, case, func, select

from gateway.db.models import BatchItem, BatchItemStatus

_NOT_FINAL = (BatchItemStatus.QUEUED, BatchItemStatus.RUNNING)


def usage_query(batch_ids: Sequence[str]) -> Select[str, Any, Any, Any]:
    """Per batch: prompt, completion and cached prompt tokens of its answered items."""
    usage = BatchItem.completion["usage"]
    cached = BatchItem.completion[("usage", "prompt_tokens_details", "cached_tokens")]
    return (
        select(
            BatchItem.batch_id,
            func.coalesce(func.sum(usage["prompt_tokens"].as_integer()), 0),
            func.coalesce(func.sum(usage["completion_tokens"].as_integer()), 0),
            func.coalesce(func.sum(cached.as_integer()), 0),
        )
        .where(
            BatchItem.batch_id.in_(batch_ids),
            BatchItem.status == BatchItemStatus.COMPLETED,
        )
        .group_by(BatchItem.batch_id)
    )


def planned_work_query(batch_ids: Sequence[str]) -> Select[str, Any, Any]:
    """Per batch: the planned tokens of all its items and of those that are final; planned is
    the prompt plus the stored (capped) prediction, else max_tokens."""
    planned = BatchItem.prompt_tokens + func.coalesce(
        BatchItem.predicted_tokens, BatchItem.max_tokens
    )
    final = BatchItem.status.not_in(_NOT_FINAL)
    return (
        select(
            BatchItem.batch_id,
            func.coalesce(func.sum(planned), 0),
            func.coalesce(func.sum(case((final, planned), else_=0)), 0),
        )
        .where(BatchItem.batch_id.in_(batch_ids))
        .group_by(BatchItem.batch_id)
    )
