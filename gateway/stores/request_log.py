"""Records each request: its row when it is accepted, its outcome when it ends.

`accepted`, `offloaded` and `finished` write one request at once (batch items, tests);
`write` takes what the write-behind queue (gateway/stores/request_writer.py) gathered from many
requests and writes it in one transaction, a statement per kind of row, as one call on a
worker thread (gateway/db/transaction_thread.py: one hand-off per batch, not one per driver
call). Timings observed in between (first token) are carried in memory and written with the
outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Connection, Table, bindparam, insert, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import (
    InferenceRequest,
    LengthSample,
    OffloadEvent,
    RequestStatus,
    utcnow,
)
from gateway.db.transaction_thread import TransactionThread


@dataclass(frozen=True, slots=True)
class NewRequest:
    request_id: str
    api: str
    model: str
    stream: bool
    user: str | None
    prompt_tokens: int
    max_tokens: int
    routing_policy: str
    site_id: int | None
    predicted_tokens: int | None = None
    predicted_bucket: int | None = None
    predictor_version: str | None = None
    predicted_p90_tokens: int | None = None
    routing_detail: dict[str, object] | None = None
    # The caller's API key, when it sent one (usage per key is summed from these rows).
    api_key_id: int | None = None
    # The LoRA adapter of `model` the request was for (None: the base).
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class NewSample:
    """A finished request's prompt and true answer length, for retraining the predictor."""

    model: str
    prompt: str
    prompt_tokens: int
    completion_tokens: int
    censored: bool
    predicted_tokens: int | None


@dataclass(frozen=True, slots=True)
class Outcome:
    status: RequestStatus
    site_id: int | None
    attempts: int
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: datetime | None = None
    # Sites an answer moved between mid-stream ({"from", "to", "after_tokens"}), in order.
    continuations: list[dict[str, object]] | None = None


@dataclass(slots=True)
class LogBatch:
    """Rows of many requests, written in one transaction in this order (the offload events and
    length samples point at request rows inserted before them)."""

    # Request rows not written yet (an outcome that arrived before the row was written is in
    # it already, so such a request costs one insert).
    inserts: list[dict[str, Any]] = field(default_factory=list)
    offloads: list[dict[str, Any]] = field(default_factory=list)
    # Rows written earlier that moved site ({"b_id", "b_site_id"}).
    moves: list[dict[str, Any]] = field(default_factory=list)
    # Outcomes of rows written earlier (keys: "b_id" and "b_" + each outcome column).
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(map(len, (self.inserts, self.offloads, self.moves, self.outcomes)))


OUTCOME_COLUMNS = (
    "status",
    "site_id",
    "attempts",
    "completion_tokens",
    "finish_reason",
    "error",
    "first_token_at",
    "continuations",
    "finished_at",
)
# A row's columns that hold free-form data (the client's `user`, routing and error details): a
# row the database refuses for what it holds is written again without them, so that what usage
# is summed from (key, tokens, status) is never dropped with them.
FREE_FORM_COLUMNS = ("user", "routing_detail", "error", "continuations")
_REQUESTS = cast(Table, InferenceRequest.__table__)
_OFFLOADS = cast(Table, OffloadEvent.__table__)
_SAMPLES = cast(Table, LengthSample.__table__)
# Executed with one parameter set per row (executemany): "b_" names, since SQLAlchemy keeps a
# column's own name for its automatic parameter.
_MOVE = update(_REQUESTS).where(_REQUESTS.c.id == bindparam("b_id"))
_MOVE = _MOVE.values(site_id=bindparam("b_site_id"))
_FINISH = update(_REQUESTS).where(_REQUESTS.c.id == bindparam("b_id"))
_FINISH = _FINISH.values({name: bindparam(f"b_{name}") for name in OUTCOME_COLUMNS})


def request_row(new: NewRequest, now: datetime) -> dict[str, Any]:
    """The request's row as accepted at `now` (dispatched; or failed at once without a site)."""
    return {
        "id": new.request_id,
        "api": new.api,
        "model": new.model,
        "adapter": new.adapter,
        "status": RequestStatus.DISPATCHED,
        "stream": new.stream,
        "user": new.user,
        "prompt_tokens": new.prompt_tokens,
        "max_tokens": new.max_tokens,
        "completion_tokens": None,
        "finish_reason": None,
        "predicted_tokens": new.predicted_tokens,
        "predicted_bucket": new.predicted_bucket,
        "predictor_version": new.predictor_version,
        "predicted_p90_tokens": new.predicted_p90_tokens,
        "routing_policy": new.routing_policy,
        "routing_detail": new.routing_detail,
        "site_id": new.site_id,
        "api_key_id": new.api_key_id,
        "attempts": 1,
        "continuations": None,
        "error": None,
        "created_at": now,
        "dispatched_at": now if new.site_id is not None else None,
        "first_token_at": None,
        "finished_at": None,
    }


def accounting_only(values: dict[str, Any] | None) -> dict[str, Any] | None:
    """A row's or an outcome's columns with the free-form ones emptied."""
    if values is None:
        return None
    return values | {name: None for name in FREE_FORM_COLUMNS if name in values}


def outcome_values(outcome: Outcome, now: datetime) -> dict[str, Any]:
    """The outcome's columns, finished at `now`."""
    return {
        "status": outcome.status,
        "site_id": outcome.site_id,
        "attempts": outcome.attempts,
        "completion_tokens": outcome.completion_tokens,
        "finish_reason": outcome.finish_reason,
        "error": outcome.error,
        "first_token_at": outcome.first_token_at,
        "continuations": outcome.continuations,
        "finished_at": now,
    }


def sample_row(request_id: str, sample: NewSample, now: datetime) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "model": sample.model,
        "prompt": sample.prompt,
        "prompt_tokens": sample.prompt_tokens,
        "completion_tokens": sample.completion_tokens,
        "censored": sample.censored,
        "predicted_tokens": sample.predicted_tokens,
        "created_at": now,
    }


def write_batch(connection: Connection, batch: LogBatch) -> None:
    """The batch's statements, in the order LogBatch gives (inside the caller's transaction)."""
    if batch.inserts:
        connection.execute(insert(_REQUESTS), batch.inserts)
    if batch.offloads:
        connection.execute(insert(_OFFLOADS), batch.offloads)
    if batch.moves:
        connection.execute(_MOVE, batch.moves)
    if batch.outcomes:
        connection.execute(_FINISH, batch.outcomes)
    if batch.samples:
        connection.execute(insert(_SAMPLES), batch.samples)


class RequestLog:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions
        # The batches' own thread and connection on the same database (close() ends them).
        self._transactions = TransactionThread.beside(sessions)

    async def accepted(self, new: NewRequest) -> None:
        now = utcnow()
        async with self._sessions.begin() as session:
            session.add(
                InferenceRequest(
                    id=new.request_id,
                    api=new.api,
                    model=new.model,
                    adapter=new.adapter,
                    status=RequestStatus.DISPATCHED,
                    stream=new.stream,
                    user=new.user,
                    prompt_tokens=new.prompt_tokens,
                    max_tokens=new.max_tokens,
                    predicted_tokens=new.predicted_tokens,
                    predicted_bucket=new.predicted_bucket,
                    predictor_version=new.predictor_version,
                    predicted_p90_tokens=new.predicted_p90_tokens,
                    routing_detail=new.routing_detail,
                    routing_policy=new.routing_policy,
                    site_id=new.site_id,
                    api_key_id=new.api_key_id,
                    attempts=1,
                    created_at=now,
                    dispatched_at=now if new.site_id is not None else None,
                )
            )

    async def offloaded(self, request_id: str, from_site_id: int, to_site_id: int) -> None:
        async with self._sessions.begin() as session:
            session.add(
                OffloadEvent(
                    request_id=request_id, from_site_id=from_site_id, to_site_id=to_site_id
                )
            )
            await session.execute(
                update(InferenceRequest)
                .where(InferenceRequest.id == request_id)
                .values(site_id=to_site_id)
            )

    async def finished(
        self, request_id: str, outcome: Outcome, sample: NewSample | None = None
    ) -> None:
        """Records the outcome, and the length sample with it in the same transaction."""
        async with self._sessions.begin() as session:
            if sample is not None:
                session.add(
                    LengthSample(
                        request_id=request_id,
                        model=sample.model,
                        prompt=sample.prompt,
                        prompt_tokens=sample.prompt_tokens,
                        completion_tokens=sample.completion_tokens,
                        censored=sample.censored,
                        predicted_tokens=sample.predicted_tokens,
                    )
                )
            await session.execute(
                update(InferenceRequest)
                .where(InferenceRequest.id == request_id)
                .values(
                    status=outcome.status,
                    site_id=outcome.site_id,
                    attempts=outcome.attempts,
                    completion_tokens=outcome.completion_tokens,
                    finish_reason=outcome.finish_reason,
                    error=outcome.error,
                    first_token_at=outcome.first_token_at,
                    continuations=outcome.continuations,
                    finished_at=utcnow(),
                )
            )

    async def write(self, batch: LogBatch) -> None:
        """Writes the batch in one transaction, each kind of row in one statement."""
        await self._transactions.run(lambda connection: write_batch(connection, batch))

    async def close(self) -> None:
        await self._transactions.close()
