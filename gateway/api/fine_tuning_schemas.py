"""Wire schemas of the fine-tuning API (msgspec), shaped like OpenAI's fine_tuning.job,
fine_tuning.job.event and fine_tuning.job.checkpoint objects. The ORM models are separate
(gateway/db/models/fine_tuning.py); times are Unix seconds."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from gateway.fine_tuning.request import JobCreateRequest as JobCreateRequest

JobStatusName = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]


class JobHyperparameters(msgspec.Struct):
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float


class JobError(msgspec.Struct):
    code: str
    message: str
    param: str | None = None


class FineTuningJobObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    model: str
    status: JobStatusName
    training_file: str
    validation_file: str | None
    hyperparameters: JobHyperparameters
    seed: int
    # The model serving the trained adapter, once succeeded: ft:<base>:<suffix>:<id>.
    fine_tuned_model: str | None
    finished_at: int | None
    # Tokens the site has trained on (forward and backward), the job's usage.
    trained_tokens: int | None
    error: JobError | None
    # This gateway has no organisations; OpenAI's clients expect the field.
    organization_id: str = "fedllm"
    result_files: list[str] = msgspec.field(default_factory=list)
    estimated_finish: int | None = None
    integrations: list[Any] | None = None
    metadata: dict[str, str] | None = None
    # This gateway's extensions: the suffix asked for, and the training progress.
    user_provided_suffix: str | None = None
    site: str | None = None
    step: int = 0
    total_steps: int = 0


class FineTuningJobList(msgspec.Struct):
    data: list[FineTuningJobObject]
    has_more: bool
    object: Literal["list"] = "list"


class FineTuningEventObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None


class FineTuningEventList(msgspec.Struct):
    data: list[FineTuningEventObject]
    has_more: bool
    object: Literal["list"] = "list"


class CheckpointMetrics(msgspec.Struct):
    step: int
    train_loss: float


class FineTuningCheckpointObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuning_job_id: str
    # The checkpoint's name (not served: only the final adapter is a model).
    fine_tuned_model_checkpoint: str
    step_number: int
    metrics: CheckpointMetrics


class FineTuningCheckpointList(msgspec.Struct):
    data: list[FineTuningCheckpointObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"
