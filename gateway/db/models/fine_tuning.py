"""LoRA fine-tuning jobs of the OpenAI fine-tuning API (issue 54), their events and checkpoints.

The gateway owns a job as the API shows it; a site trains it (gateway/fine_tuning/runner.py
asks the site for its progress and writes it here), so that a restarted gateway goes on polling
the jobs it had, and a succeeded job's adapter is served again under its model name.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import Base, UTCDateTime, checked_enum, utcnow


class FineTuningStatus(enum.StrEnum):
    """OpenAI's job statuses. A job is made `validating_files` (its key's place taken at once,
    so that concurrent creates cannot all pass its limits) and leaves it when its files are
    checked: queued, or failed naming the bad lines (gateway/fine_tuning/service.py)."""

    VALIDATING_FILES = (
        "validating_files"  # its files are being checked (16 characters: the column's)
    )
    QUEUED = "queued"  # waiting for a site that accepts jobs of its base
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in FINAL_FINE_TUNING_STATES


FINAL_FINE_TUNING_STATES = frozenset(
    {FineTuningStatus.SUCCEEDED, FineTuningStatus.FAILED, FineTuningStatus.CANCELLED}
)


class FineTuningJob(Base):
    """One job. Its status moves only forward and never out of a final one (every update is
    conditional on a status that is not final)."""

    __tablename__ = "fine_tuning_jobs"
    __table_args__ = (
        Index("ix_fine_tuning_jobs_api_key_id_created_at", "api_key_id", "created_at"),
        Index("ix_fine_tuning_jobs_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The key that created it, the only one that sees it and may use its model (null: made
    # without a key, seen only by callers without one).
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    # The key's name when it was made: the trained adapter's owner in the model catalogue.
    owner_key_name: Mapped[str | None] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(128))  # the base model
    training_file: Mapped[str] = mapped_column(String(64))
    validation_file: Mapped[str | None] = mapped_column(String(64))
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(BigInteger)
    # The hyperparameters, "auto" resolved at creation.
    n_epochs: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    learning_rate_multiplier: Mapped[float] = mapped_column(Float)
    status: Mapped[FineTuningStatus] = mapped_column(
        checked_enum(FineTuningStatus, "fine_tuning_status"), default=FineTuningStatus.QUEUED
    )
    # The site training it (null until one took it).
    site: Mapped[str | None] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    trained_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # The last training step written as a "metrics" event (a report replaces the previous one;
    # only steps past this one are new).
    reported_step: Mapped[int] = mapped_column(Integer, default=0)
    # Once succeeded: the adapter directory on the site, and the model serving it.
    adapter_path: Mapped[str | None] = mapped_column(Text)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(256))
    # Once failed: OpenAI's error object {code, message, param}.
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class FineTuningEvent(Base):
    """What happened to a job, in order (`id`): "message" events of its status and "metrics"
    events of its training steps (data: step, train_loss, ...)."""

    __tablename__ = "fine_tuning_events"
    __table_args__ = (Index("ix_fine_tuning_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("fine_tuning_jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    level: Mapped[str] = mapped_column(String(8))  # info, warn, error
    type: Mapped[str] = mapped_column(String(16))  # message, metrics
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class FineTuningCheckpoint(Base):
    """A checkpoint its site wrote (a PEFT adapter directory on the site's disk)."""

    __tablename__ = "fine_tuning_checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("fine_tuning_jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    train_loss: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
