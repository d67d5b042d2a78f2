"""SQL of fine-tuning jobs, their events and checkpoints (gateway/fine_tuning/ decides what is
written and when).

A client's reads are scoped to the key that owns the job: another key's job reads as one that
does not exist. Every change of a job's status is conditional on its status not being final,
in the same transaction as the event that tells it, so a final job never changes again and
two gateways polling the same job write each step's event once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from fedllm_contract.fine_tuning import FineTuneProgress, FineTuneState
from gateway.db.models import (
    FINAL_FINE_TUNING_STATES,
    ApiKey,
    FineTuningCheckpoint,
    FineTuningEvent,
    FineTuningJob,
    FineTuningStatus,
    StoredFile,
    utcnow,
)
from gateway.db.session import SessionStore
from gateway.stores.file_store import file_exists, owned_by
from gateway.stores.pages import Owner, Page, rowcount

_NOT_FINAL = FineTuningJob.status.not_in([s.value for s in FINAL_FINE_TUNING_STATES])
_STATUS_OF_STATE = {state: FineTuningStatus(state.value) for state in FineTuneState}
EVENT_PREFIX = "ftevent-"


@dataclass(frozen=True, slots=True)
class NewJob:
    """What a job is asked to do, as the gateway resolved it (its "auto" settings filled in)."""

    id: str
    owner: Owner
    owner_key_name: str | None
    model: str
    training_file: str
    validation_file: str | None
    suffix: str | None
    seed: int
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float


# The error codes of a job whose files were refused when it was made: it costs its key one
# reading of them (gateway/fine_tuning/limits.py).
REFUSED_FILE_CODES = frozenset({"invalid_training_file"})


@dataclass(frozen=True, slots=True)
class JobUse:
    """One of a key's jobs as its training limits see it (gateway/fine_tuning/limits.py)."""

    final: bool
    trained_tokens: int
    epochs: int
    training_bytes: int  # 0 when its training file is gone
    validating: bool = False  # its files are being checked now
    refused_files: bool = False  # it failed because its files were refused


@dataclass(frozen=True, slots=True)
class JobView(NewJob):
    """A job as stored: what it was asked to do and how far it got."""

    status: FineTuningStatus
    site: str | None
    step: int
    total_steps: int
    trained_tokens: int
    adapter_path: str | None
    fine_tuned_model: str | None
    error: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class EventView:
    id: str
    created_at: datetime
    level: str
    type: str
    message: str
    data: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class CheckpointView:
    id: str
    job_id: str
    step: int
    path: str
    train_loss: float
    created_at: datetime


def _job(row: FineTuningJob) -> JobView:
    return JobView(
        row.id,
        row.api_key_id,
        row.owner_key_name,
        row.model,
        row.training_file,
        row.validation_file,
        row.suffix,
        row.seed,
        row.n_epochs,
        row.batch_size,
        row.learning_rate_multiplier,
        row.status,
        row.site,
        row.step,
        row.total_steps,
        row.trained_tokens,
        row.adapter_path,
        row.fine_tuned_model,
        row.error,
        row.created_at,
        row.started_at,
        row.finished_at,
    )


def _event(row: FineTuningEvent) -> EventView:
    return EventView(
        f"{EVENT_PREFIX}{row.id}", row.created_at, row.level, row.type, row.message, row.data
    )


def _add_event(
    session: AsyncSession,
    job_id: str,
    message: str,
    level: str = "info",
    kind: str = "message",
    data: dict[str, Any] | None = None,
) -> None:
    session.add(
        FineTuningEvent(
            job_id=job_id, created_at=utcnow(), level=level, type=kind, message=message, data=data
        )
    )


class FineTuningStore(SessionStore):
    async def create(
        self,
        new: NewJob,
        admit: Callable[[list[JobUse]], None] | None = None,
        since: datetime | None = None,
    ) -> JobView | None:
        """The job, `validating_files`, and its first event, in one transaction; None (nothing
        written) when either file is not the owner's live file (deleted in between). `admit` is
        given the owner's jobs made since `since` (the limits' window began) or still
        unfinished, read with the owner's key row locked (so that concurrent creates of one
        key, on any gateway, take turns, each seeing the jobs the others made); what it raises
        undoes everything."""
        async with self._sessions.begin() as session:
            if admit is not None:
                admit(await _uses(session, new.owner, since or utcnow()))
            for file_id in (new.training_file, new.validation_file):
                if file_id is not None and not await file_exists(session, file_id, new.owner):
                    return None
            row = FineTuningJob(
                id=new.id,
                api_key_id=new.owner,
                owner_key_name=new.owner_key_name,
                model=new.model,
                training_file=new.training_file,
                validation_file=new.validation_file,
                suffix=new.suffix,
                seed=new.seed,
                n_epochs=new.n_epochs,
                batch_size=new.batch_size,
                learning_rate_multiplier=new.learning_rate_multiplier,
                status=FineTuningStatus.VALIDATING_FILES,
                step=0,
                total_steps=0,
                trained_tokens=0,
                reported_step=0,
                created_at=utcnow(),
            )
            session.add(row)
            await session.flush()
            _add_event(session, new.id, f"Created fine-tuning job: {new.id}")
            return _job(row)

    async def uses(self, owner: Owner, since: datetime) -> list[JobUse]:
        """The owner's jobs made since `since` or still unfinished."""
        async with self._sessions.begin() as session:
            return await _uses(session, owner, since)

    async def get(self, job_id: str, owner: Owner) -> JobView | None:
        async with self._sessions() as session:
            row = await session.scalar(
                select(FineTuningJob).where(
                    FineTuningJob.id == job_id, owned_by(FineTuningJob.api_key_id, owner)
                )
            )
            return _job(row) if row is not None else None

    async def list_jobs(self, owner: Owner, after: str | None, limit: int) -> Page[JobView] | None:
        """The owner's jobs, newest first, from just after the job `after`; None when `after`
        is not one of them."""
        created, key = FineTuningJob.created_at, FineTuningJob.id
        query = select(FineTuningJob).where(owned_by(FineTuningJob.api_key_id, owner))
        if after is not None:
            cursor = await self.get(after, owner)
            if cursor is None:
                return None
            query = query.where(
                or_(created < cursor.created_at, and_(created == cursor.created_at, key < after))
            )
        query = query.order_by(created.desc(), key.desc()).limit(limit + 1)
        async with self._sessions() as session:
            rows = (await session.scalars(query)).all()
        return Page([_job(row) for row in rows[:limit]], has_more=len(rows) > limit)

    async def events(self, job_id: str, after: str | None, limit: int) -> Page[EventView]:
        """The job's events, newest first, from just before the event `after` (its id)."""
        query = select(FineTuningEvent).where(FineTuningEvent.job_id == job_id)
        if after is not None:
            number = after.removeprefix(EVENT_PREFIX)
            # Past the column's range (32 bits): before every event.
            before = min(int(number), 2**31 - 1) if number.isdigit() else 0
            query = query.where(FineTuningEvent.id < before)
        query = query.order_by(FineTuningEvent.id.desc()).limit(limit + 1)
        async with self._sessions() as session:
            rows = (await session.scalars(query)).all()
        return Page([_event(row) for row in rows[:limit]], has_more=len(rows) > limit)

    async def checkpoints(self, job_id: str, after: str | None, limit: int) -> Page[CheckpointView]:
        """The job's checkpoints, latest step first, from just after the checkpoint `after`."""
        query = select(FineTuningCheckpoint).where(FineTuningCheckpoint.job_id == job_id)
        async with self._sessions() as session:
            if after is not None:
                cursor = await session.get(FineTuningCheckpoint, after)
                step = cursor.step if cursor is not None and cursor.job_id == job_id else -1
                query = query.where(FineTuningCheckpoint.step < step)
            query = query.order_by(FineTuningCheckpoint.step.desc()).limit(limit + 1)
            rows = (await session.scalars(query)).all()
        views = [
            CheckpointView(r.id, r.job_id, r.step, r.path, r.train_loss, r.created_at)
            for r in rows[:limit]
        ]
        return Page(views, has_more=len(rows) > limit)

    async def unfinished(self) -> list[JobView]:
        """Every job not final, oldest first (whoever owns it: the runner's view)."""
        query = select(FineTuningJob).where(_NOT_FINAL).order_by(FineTuningJob.created_at)
        async with self._sessions() as session:
            return [_job(row) for row in (await session.scalars(query)).all()]

    async def served(self) -> list[JobView]:
        """The succeeded jobs whose adapters the federation serves."""
        query = select(FineTuningJob).where(
            FineTuningJob.status == FineTuningStatus.SUCCEEDED,
            FineTuningJob.fine_tuned_model.is_not(None),
        )
        async with self._sessions() as session:
            return [_job(row) for row in (await session.scalars(query)).all()]

    async def count_by_status(self) -> dict[FineTuningStatus, int]:
        query = select(FineTuningJob.status, func.count()).group_by(FineTuningJob.status)
        async with self._sessions() as session:
            rows = (await session.execute(query)).all()
        return {FineTuningStatus(status): int(count) for status, count in rows}

    async def trained_tokens(self, owner: int, since: datetime) -> int:
        """Tokens trained by the key's jobs created since `since` (a running job's so far)."""
        query = select(func.coalesce(func.sum(FineTuningJob.trained_tokens), 0)).where(
            FineTuningJob.api_key_id == owner, FineTuningJob.created_at >= since
        )
        async with self._sessions() as session:
            return int(await session.scalar(query) or 0)

    async def validated(self, job_id: str, batch_size: int, examples: int) -> JobView | None:
        """Moves a job whose files were checked from validating_files to queued, its batch
        size resolved from its examples; None when it is no longer validating (cancelled)."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(FineTuningJob)
                .where(
                    FineTuningJob.id == job_id,
                    FineTuningJob.status == FineTuningStatus.VALIDATING_FILES,
                )
                .values(status=FineTuningStatus.QUEUED, batch_size=batch_size)
            )
            if rowcount(result) != 1:
                return None
            _add_event(session, job_id, f"Files validated: {examples} training examples")
            row = await session.get(FineTuningJob, job_id)
            assert row is not None
            return _job(row)

    async def note(self, job_id: str, message: str, level: str = "warn") -> None:
        """An event of the job that changes nothing else."""
        async with self._sessions.begin() as session:
            _add_event(session, job_id, message, level=level)

    async def placements(
        self, job_ids: list[str]
    ) -> dict[str, tuple[FineTuningStatus, str | None]]:
        """The status and site of each of the jobs the database has."""
        query = select(FineTuningJob.id, FineTuningJob.status, FineTuningJob.site).where(
            FineTuningJob.id.in_(job_ids)
        )
        async with self._sessions() as session:
            rows = (await session.execute(query)).all()
        return {job_id: (FineTuningStatus(status), site) for job_id, status, site in rows}

    async def assign(self, job_id: str, site: str) -> bool:
        """Gives the queued, unassigned job to `site`; False when another gateway did first."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(FineTuningJob)
                .where(
                    FineTuningJob.id == job_id,
                    FineTuningJob.site.is_(None),
                    FineTuningJob.status == FineTuningStatus.QUEUED,
                )
                .values(site=site)
            )
            if rowcount(result) != 1:
                return False
            _add_event(session, job_id, f"Fine-tuning job assigned to site {site}")
            return True

    async def unassign(self, job_id: str, why: str) -> None:
        """The site did not take the job: it waits for a site again."""
        async with self._sessions.begin() as session:
            await session.execute(
                update(FineTuningJob)
                .where(FineTuningJob.id == job_id, _NOT_FINAL)
                .values(site=None, status=FineTuningStatus.QUEUED)
            )
            _add_event(session, job_id, why, level="warn")

    async def record(self, progress: FineTuneProgress) -> JobView | None:
        """The site's report of a job not final: its step, tokens and status, a "metrics" event
        per step not written yet, and checkpoints not written yet. None when the job is final
        (or gone). A final state in the report is not applied here: see `finish`."""
        async with self._sessions.begin() as session:
            row = await session.scalar(
                select(FineTuningJob)
                .where(FineTuningJob.id == progress.job_id, _NOT_FINAL)
                .with_for_update()
            )
            if row is None:
                return None
            _record_steps(session, row, progress)
            await _record_checkpoints(session, row, progress)
            row.step, row.total_steps = progress.step, progress.total_steps
            row.trained_tokens = max(row.trained_tokens, progress.trained_tokens)
            # Running, or trained already between two polls: it started.
            started = progress.state in (FineTuneState.RUNNING, FineTuneState.SUCCEEDED)
            if started and row.status is FineTuningStatus.QUEUED:
                row.status, row.started_at = FineTuningStatus.RUNNING, utcnow()
                _add_event(session, row.id, f"Fine-tuning job started on site {row.site}")
            await session.flush()
            return _job(row)

    async def finish(
        self,
        job_id: str,
        status: FineTuningStatus,
        message: str,
        *,
        error: dict[str, Any] | None = None,
        adapter_path: str | None = None,
        fine_tuned_model: str | None = None,
    ) -> bool:
        """Moves a job that is not final to the final `status`, with its event; False when it
        was final already (nothing changes)."""
        assert status.is_final
        now = utcnow()
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(FineTuningJob)
                .where(FineTuningJob.id == job_id, _NOT_FINAL)
                .values(
                    status=status,
                    finished_at=now,
                    error=error,
                    adapter_path=adapter_path,
                    fine_tuned_model=fine_tuned_model,
                )
            )
            if rowcount(result) != 1:
                return False
            level = "error" if status is FineTuningStatus.FAILED else "info"
            _add_event(session, job_id, message, level=level)
            return True


async def _uses(session: AsyncSession, owner: Owner, since: datetime) -> list[JobUse]:
    if owner is not None:
        await session.execute(select(ApiKey.id).where(ApiKey.id == owner).with_for_update())
    query = (
        select(
            FineTuningJob.status,
            FineTuningJob.trained_tokens,
            FineTuningJob.n_epochs,
            StoredFile.bytes,
            FineTuningJob.error,
        )
        .outerjoin(StoredFile, StoredFile.id == FineTuningJob.training_file)
        .where(
            owned_by(FineTuningJob.api_key_id, owner),
            or_(FineTuningJob.created_at >= since, _NOT_FINAL),
        )
    )
    uses = []
    for status, trained, epochs, size, error in (await session.execute(query)).all():
        state = FineTuningStatus(status)
        code = error.get("code") if isinstance(error, dict) else None
        uses.append(
            JobUse(
                state.is_final,
                int(trained),
                int(epochs),
                int(size or 0),
                validating=state is FineTuningStatus.VALIDATING_FILES,
                refused_files=state is FineTuningStatus.FAILED and code in REFUSED_FILE_CODES,
            )
        )
    return uses


def _record_steps(session: AsyncSession, row: FineTuningJob, progress: FineTuneProgress) -> None:
    validation = dict(progress.validation_losses)
    for step, loss in progress.losses:
        if step <= row.reported_step:
            continue
        data: dict[str, Any] = {
            "step": step,
            "train_loss": loss,
            "total_steps": progress.total_steps,
        }
        if step in validation:
            data["valid_loss"] = validation[step]
        _add_event(
            session,
            row.id,
            f"Step {step}/{progress.total_steps}: training loss={loss:.4f}",
            kind="metrics",
            data=data,
        )
        row.reported_step = step


async def _record_checkpoints(
    session: AsyncSession, row: FineTuningJob, progress: FineTuneProgress
) -> None:
    if not progress.checkpoints:
        return
    known = set(
        (
            await session.scalars(
                select(FineTuningCheckpoint.step).where(FineTuningCheckpoint.job_id == row.id)
            )
        ).all()
    )
    for checkpoint in progress.checkpoints:
        if checkpoint.step in known:
            continue
        await session.execute(
            insert(FineTuningCheckpoint).values(
                id=f"ftckpt-{uuid.uuid4().hex[:24]}",
                job_id=row.id,
                step=checkpoint.step,
                path=checkpoint.path,
                train_loss=checkpoint.train_loss,
                created_at=utcnow(),
            )
        )
        known.add(checkpoint.step)


def status_of(state: FineTuneState) -> FineTuningStatus:
    return _STATUS_OF_STATE[state]
