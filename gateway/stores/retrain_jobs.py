"""The retrain job queue: jobs asked for by an operator or the drift signal, claimed by one
worker at a time, and their results.

At most one job per model is open (queued or running): the partial unique index
`uq_retrain_jobs_open_model` refuses a second, on every gateway sharing the database. A job is
claimed by a conditional update (queued -> running), so two workers never run the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from gateway.db.models import OPEN_RETRAIN_STATES, RetrainJob, RetrainJobState, utcnow
from gateway.db.session import SessionStore
from gateway.stores.pages import rowcount

ERROR_CHARS = 4000  # what a failed job keeps of its error (the end of a traceback)


class JobAlreadyOpen(Exception):
    """The model already has a queued or running job."""

    def __init__(self, model: str) -> None:
        super().__init__(f"model {model!r} already has a queued or running retrain job")
        self.model = model


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: int
    model: str
    reason: str
    mode: str
    state: str
    drift: dict[str, object] | None
    version: str | None
    activated: bool | None
    decision: dict[str, object] | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


def _record(row: RetrainJob) -> JobRecord:
    return JobRecord(
        row.id, row.model, row.reason, row.mode, row.state.value, row.drift, row.version,
        row.activated, row.decision, row.error, row.created_at, row.started_at, row.finished_at,
    )  # fmt: skip


class RetrainJobStore(SessionStore):
    async def enqueue(
        self, model: str, *, reason: str, mode: str, drift: dict[str, object] | None = None
    ) -> JobRecord:
        """A queued job; JobAlreadyOpen when the model has one queued or running."""
        row = RetrainJob(
            model=model, reason=reason, mode=mode, state=RetrainJobState.QUEUED, drift=drift,
            created_at=utcnow(),
        )  # fmt: skip
        try:
            async with self._sessions.begin() as session:
                session.add(row)
                await session.flush()
                return _record(row)
        except IntegrityError as exc:
            raise JobAlreadyOpen(model) from exc

    async def get(self, job_id: int) -> JobRecord | None:
        async with self._sessions() as session:
            row = await session.get(RetrainJob, job_id)
            return _record(row) if row is not None else None

    async def recent(self, limit: int, model: str | None = None) -> list[JobRecord]:
        query = select(RetrainJob).order_by(RetrainJob.id.desc()).limit(limit)
        if model is not None:
            query = query.where(RetrainJob.model == model)
        async with self._sessions() as session:
            return [_record(row) for row in await session.scalars(query)]

    async def latest_by_model(self) -> dict[str, JobRecord]:
        """Each model's newest job (ids grow with time)."""
        ids = select(func.max(RetrainJob.id)).group_by(RetrainJob.model)
        async with self._sessions() as session:
            rows = await session.scalars(select(RetrainJob).where(RetrainJob.id.in_(ids)))
            return {row.model: _record(row) for row in rows}

    async def claim(self, job_id: int | None = None) -> JobRecord | None:
        """Marks a queued job running (the given one, else the oldest) and returns it; None when
        there is none, or another worker took it first."""
        async with self._sessions.begin() as session:
            if job_id is None:
                job_id = await session.scalar(
                    select(RetrainJob.id)
                    .where(RetrainJob.state == RetrainJobState.QUEUED)
                    .order_by(RetrainJob.id)
                    .limit(1)
                )
                if job_id is None:
                    return None
            claimed = await session.execute(
                update(RetrainJob)
                .where(RetrainJob.id == job_id, RetrainJob.state == RetrainJobState.QUEUED)
                .values(state=RetrainJobState.RUNNING, started_at=utcnow())
            )
            if rowcount(claimed) != 1:
                return None
            row = await session.get(RetrainJob, job_id)
            return _record(row) if row is not None else None

    async def finish(
        self, job_id: int, *, version: str, activated: bool, decision: dict[str, object]
    ) -> bool:
        return await self._settle(
            job_id, state=RetrainJobState.DONE, version=version, activated=activated,
            decision=decision,
        )  # fmt: skip

    async def fail(self, job_id: int, error: str) -> bool:
        """Records a running (or still queued) job as failed; False if it had already ended."""
        return await self._settle(job_id, state=RetrainJobState.FAILED, error=error[-ERROR_CHARS:])

    async def fail_stale(self, started_before: datetime) -> int:
        """Running jobs started before `started_before` (their worker died or hung) are failed,
        so their model can be retrained again."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(RetrainJob)
                .where(
                    RetrainJob.state == RetrainJobState.RUNNING,
                    RetrainJob.started_at < started_before,
                )
                .values(
                    state=RetrainJobState.FAILED,
                    error="abandoned: no result within GATEWAY_RETRAIN_JOB_TIMEOUT_S",
                    finished_at=utcnow(),
                )
            )
            return rowcount(result)

    async def _settle(self, job_id: int, **values: object) -> bool:
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(RetrainJob)
                .where(RetrainJob.id == job_id, RetrainJob.state.in_(OPEN_RETRAIN_STATES))
                .values(finished_at=utcnow(), **values)
            )
            return rowcount(result) == 1
