"""/v1/fine_tuning/jobs: a thin controller over FineTuningService
(gateway/fine_tuning/service.py), as the openai clients call it (fine_tuning.jobs.create, list,
retrieve, cancel, list_events, checkpoints.list)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from gateway.api.body import decode_body
from gateway.api.client_auth import require_client_key
from gateway.api.client_gone import unless_client_leaves
from gateway.api.fine_tuning_schemas import (
    CheckpointMetrics,
    FineTuningCheckpointList,
    FineTuningCheckpointObject,
    FineTuningEventList,
    FineTuningEventObject,
    FineTuningJobList,
    FineTuningJobObject,
    JobCreateRequest,
    JobError,
    JobHyperparameters,
)
from gateway.api.openapi_body import json_body
from gateway.fine_tuning.runner import fine_tuned_model
from gateway.fine_tuning.service import FineTuningService
from gateway.stores.fine_tuning_store import CheckpointView, JobView
from gateway.tenancy.admission import Caller

DEFAULT_PAGE = 20
JobId = FromPath[str]


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def job_object(job: JobView) -> FineTuningJobObject:
    error = job.error
    return FineTuningJobObject(
        id=job.id,
        created_at=int(job.created_at.timestamp()),
        model=job.model,
        status=job.status.value,
        training_file=job.training_file,
        validation_file=job.validation_file,
        hyperparameters=JobHyperparameters(
            job.n_epochs, job.batch_size, job.learning_rate_multiplier
        ),
        seed=job.seed,
        fine_tuned_model=job.fine_tuned_model,
        finished_at=_unix(job.finished_at),
        trained_tokens=job.trained_tokens if job.started_at is not None else None,
        error=JobError(str(error.get("code")), str(error.get("message")), error.get("param"))
        if error
        else None,
        user_provided_suffix=job.suffix,
        site=job.site,
        step=job.step,
        total_steps=job.total_steps,
    )


def _checkpoint(job: JobView, checkpoint: CheckpointView) -> FineTuningCheckpointObject:
    return FineTuningCheckpointObject(
        id=checkpoint.id,
        created_at=int(checkpoint.created_at.timestamp()),
        fine_tuning_job_id=job.id,
        fine_tuned_model_checkpoint=f"{fine_tuned_model(job)}:ckpt-step-{checkpoint.step}",
        step_number=checkpoint.step,
        metrics=CheckpointMetrics(checkpoint.step, checkpoint.train_loss),
    )


class FineTuningController(Controller):
    path = "/v1/fine_tuning/jobs"
    tags = ("fine-tuning",)
    guards = [require_client_key]  # noqa: RUF012 (litestar's layered attribute)

    @post(
        "/",
        status_code=200,
        summary="Create a fine-tuning job from an uploaded chat JSONL file",
        operation_class=json_body(JobCreateRequest),
    )
    async def create_job(
        self,
        request: Request[Any, Any, Any],
        fine_tuning: NamedDependency[FineTuningService],
        caller: NamedDependency[Caller],
    ) -> FineTuningJobObject:
        body = decode_body(await request.body(), JobCreateRequest)
        checked = await fine_tuning.create(body, caller.key_id, caller.key)
        # A client gone stops the wait, not the check: the server, stopping, waits for no
        # handler held by a check of minutes (issue 75).
        return job_object(await unless_client_leaves(request.receive, checked))

    @get("/", summary="The caller's fine-tuning jobs, newest first")
    async def list_jobs(
        self,
        fine_tuning: NamedDependency[FineTuningService],
        caller: NamedDependency[Caller],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = DEFAULT_PAGE,
    ) -> FineTuningJobList:
        page = await fine_tuning.list_jobs(caller.key_id, after, limit)
        return FineTuningJobList([job_object(job) for job in page.data], page.has_more)

    @get("/{fine_tuning_job_id:str}", summary="A fine-tuning job")
    async def get_job(
        self,
        fine_tuning: NamedDependency[FineTuningService],
        caller: NamedDependency[Caller],
        fine_tuning_job_id: JobId,
    ) -> FineTuningJobObject:
        return job_object(await fine_tuning.get(fine_tuning_job_id, caller.key_id))

    @post("/{fine_tuning_job_id:str}/cancel", status_code=200, summary="Cancel a fine-tuning job")
    async def cancel_job(
        self,
        fine_tuning: NamedDependency[FineTuningService],
        caller: NamedDependency[Caller],
        fine_tuning_job_id: JobId,
    ) -> FineTuningJobObject:
        return job_object(await fine_tuning.cancel(fine_tuning_job_id, caller.key_id))

    @get("/{fine_tuning_job_id:str}/events", summary="A job's events, newest first")
    async def list_events(
        self,
        fine_tuning: NamedDependency[FineTuningService],
        caller: NamedDependency[Caller],
        fine_tuning_job_id: JobId,
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = DEFAULT_PAGE,
    ) -> FineTuningEventList:
        page = await fine_tuning.events(fine_tuning_job_id, caller.key_id, after, limit)
        data = [
            FineTuningEventObject(
                id=e.id,
                created_at=int(e.created_at.timestamp()),
                level=e.level,
                message=e.message,
                type=e.type,
                data=e.data,
            )
            for e in page.data
        ]
        return FineTuningEventList(data, page.has_more)

    @get("/{fine_tuning_job_id:str}/checkpoints", summary="A job's checkpoints, latest first")
    async def list_checkpoints(
        self,
        fine_tuning: NamedDependency[FineTuningService],
        caller: NamedDependency[Caller],
        fine_tuning_job_id: JobId,
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = 10,
    ) -> FineTuningCheckpointList:
        job = await fine_tuning.get(fine_tuning_job_id, caller.key_id)
        page = await fine_tuning.checkpoints(fine_tuning_job_id, caller.key_id, after, limit)
        data = [_checkpoint(job, c) for c in page.data]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return FineTuningCheckpointList(data, page.has_more, first, last)
