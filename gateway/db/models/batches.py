"""Offline batches, their items, and the uploaded files they read and write."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import Base, UTCDateTime, checked_enum, utcnow


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"  # accepted; lengths being predicted and sites assigned
    IN_PROGRESS = "in_progress"
    # Every item final; the output and error files are being written.
    FINALIZING = "finalizing"
    COMPLETED = "completed"  # every item final and at least one completed
    FAILED = "failed"  # every item final and none completed
    CANCELLING = "cancelling"  # cancel asked; running items are being stopped (then the files)
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its completion window passed before every item was final


class BatchItemStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class BatchJob(Base):
    """An offline batch (POST /v1/batches): its counters are updated in the same transaction as
    the item that moves them, so they always agree with batch_items."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_created_at", "created_at"),
        Index("ix_batches_status", "status"),
        Index("ix_batches_api_key_id_created_at", "api_key_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The key that created it, the only one that sees it (null: made without a key, seen only
    # by callers without one). Its items' request rows carry the same key, for usage.
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    model: Mapped[str] = mapped_column(String(128))
    # The endpoint every item is a request of: /v1/completions or /v1/chat/completions.
    endpoint: Mapped[str] = mapped_column(
        String(32), default="/v1/completions", server_default="/v1/completions"
    )
    # The uploaded file the items came from (null: submitted inline); items are copied at
    # creation, so deleting the file later changes nothing.
    input_file_id: Mapped[str | None] = mapped_column(String(64))
    completion_window: Mapped[str | None] = mapped_column(String(16))
    # Past it, items not yet final are stopped and the batch ends `expired`.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    status: Mapped[BatchStatus] = mapped_column(checked_enum(BatchStatus, "batch_status"))
    # `metadata` is taken by the declarative base; the column keeps the wire name.
    meta: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    total: Mapped[int] = mapped_column(Integer)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    cancelled: Mapped[int] = mapped_column(Integer, default=0)
    # The gateway running the batch and until when; another one takes it over once this lapses.
    owner: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # When its last item became final (its files are written next).
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # The files of its results, written when it settles: answers, and failures.
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))


class BatchItem(Base):
    """One request of a batch: what was asked, where MICO assigned it and why, and its result.

    `attempts` counts starts and fences results: a result is written only by the attempt that
    started the item last, so an item recorded final is never run or written again.
    """

    __tablename__ = "batch_items"
    __table_args__ = (
        Index("ix_batch_items_batch_id_custom_id", "batch_id", "custom_id", unique=True),
        Index("ix_batch_items_batch_id_status", "batch_id", "status"),
        Index("ix_batch_items_batch_id_site_id_plan_rank", "batch_id", "site_id", "plan_rank"),
    )

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    item_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    custom_id: Mapped[str] = mapped_column(String(256))
    # The item as submitted, less custom_id: validated again at each start.
    body: Mapped[dict[str, object]] = mapped_column(JSON)
    status: Mapped[BatchItemStatus] = mapped_column(
        checked_enum(BatchItemStatus, "batch_item_status")
    )
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    max_tokens: Mapped[int] = mapped_column(Integer)
    predicted_tokens: Mapped[int | None] = mapped_column(Integer)
    predicted_bucket: Mapped[int | None] = mapped_column(Integer)
    predictor_version: Mapped[str | None] = mapped_column(String(64))
    site_id: Mapped[int | None] = mapped_column(ForeignKey("sites.id", ondelete="SET NULL"))
    assign_reason: Mapped[str | None] = mapped_column(Text)
    # Where the batch plan (gateway/batches/plan.py) puts the item in its site's order: a site's
    # items start by increasing rank (ties by index). Submission order until the plan is made.
    plan_rank: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # The request of the latest attempt (its row in `requests` is written by the request log).
    request_id: Mapped[str | None] = mapped_column(String(64))
    completion: Mapped[dict[str, object] | None] = mapped_column(JSON)
    error: Mapped[dict[str, object] | None] = mapped_column(JSON)
    # The HTTP status the endpoint would have answered a failed item with (null when it was
    # stopped rather than failed: cancelled or expired), for the batch's error file.
    status_code: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class StoredFile(Base):
    """A file of the Files API: an upload (purpose `batch`) or a batch's output or error file
    (`batch_output`). Its bytes are in file_parts; it belongs to one key (null: made without a
    key, seen only by callers without one) and is deleted once `expires_at` passes."""

    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_api_key_id_created_at", "api_key_id", "created_at"),
        Index("ix_files_expires_at", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(256))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # The batch that wrote it (its output or error file); null for an upload.
    batch_id: Mapped[str | None] = mapped_column(String(64))


class FilePart(Base):
    """One piece of a file's bytes, in order: a file is read and written a part at a time, so
    neither side holds a whole large file in one row or one message."""

    __tablename__ = "file_parts"

    file_id: Mapped[str] = mapped_column(
        ForeignKey("files.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    data: Mapped[bytes] = mapped_column(LargeBinary)
