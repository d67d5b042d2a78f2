"""The length predictor's registry and the retrain jobs that adapt it."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import JSON, Boolean, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import Base, UTCDateTime, checked_enum, utcnow


class PredictorVersion(Base):
    """A registered predictor artifact; the gateway serves each model's active one and follows
    changes."""

    __tablename__ = "predictor_versions"
    __table_args__ = (Index("ix_predictor_versions_model_active", "model", "active"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[str] = mapped_column(String(64), unique=True)
    # The served model it predicts; "" is the default for every model without its own. One
    # version per model is active.
    model: Mapped[str] = mapped_column(String(128), default="", server_default="")
    path: Mapped[str] = mapped_column(String(1024))
    kind: Mapped[str] = mapped_column(String(32))
    scheme: Mapped[str] = mapped_column(String(64))
    metrics: Mapped[dict[str, object]] = mapped_column(JSON, default=dict)
    active: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    activated_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class RetrainJobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"  # a candidate was built and the gate decided (activated or not)
    FAILED = "failed"


OPEN_RETRAIN_STATES = (RetrainJobState.QUEUED, RetrainJobState.RUNNING)


_OPEN_RETRAIN_JOB = "state IN ('queued', 'running')"


class RetrainJob(Base):
    """A request to adapt one served model's predictor (an operator's, or the drift signal's),
    and what became of it. At most one job per model is open (queued or running): the partial
    unique index holds that for every gateway sharing the database."""

    __tablename__ = "retrain_jobs"
    __table_args__ = (
        Index("ix_retrain_jobs_model_created_at", "model", "created_at"),
        Index(
            "uq_retrain_jobs_open_model",
            "model",
            unique=True,
            postgresql_where=text(_OPEN_RETRAIN_JOB),
            sqlite_where=text(_OPEN_RETRAIN_JOB),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(String(16))  # manual | drift
    mode: Mapped[str] = mapped_column(String(16))  # calibrate | retrain
    state: Mapped[RetrainJobState] = mapped_column(checked_enum(RetrainJobState, "job_state"))
    # The rolling error when the job was asked for ({"mae_tokens", "mae_ratio", ...}).
    drift: Mapped[dict[str, object] | None] = mapped_column(JSON(none_as_null=True))
    version: Mapped[str | None] = mapped_column(String(64))  # the candidate it registered
    activated: Mapped[bool | None] = mapped_column(Boolean)
    # The activation gate's decision with its numbers (as stored with the version).
    decision: Mapped[dict[str, object] | None] = mapped_column(JSON(none_as_null=True))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
