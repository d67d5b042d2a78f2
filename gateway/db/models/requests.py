"""Sites and the requests they served: the request log, its length samples and offloads."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import JSON, Boolean, Enum, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from gateway.db.models.base import Base, UTCDateTime, utcnow


class RequestStatus(enum.StrEnum):
    DISPATCHED = "dispatched"  # accepted and sent to a site; no token yet
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Site(Base):
    __tablename__ = "sites"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    cloud: Mapped[str] = mapped_column(String(32))
    region: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(128))
    capacity_weight: Mapped[float] = mapped_column(Float, default=1.0)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)

    requests: Mapped[list[InferenceRequest]] = relationship(back_populates="site")


class InferenceRequest(Base):
    """One client request: what was asked, what was predicted and decided, and how it ended."""

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_created_at", "created_at"),
        Index("ix_requests_site_id_created_at", "site_id", "created_at"),
        Index("ix_requests_status", "status"),
        Index("ix_requests_api_key_id_created_at", "api_key_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(128))
    # The LoRA adapter of `model` the request was for (None: the base model itself).
    adapter: Mapped[str | None] = mapped_column(String(128), nullable=True, default=None)
    status: Mapped[RequestStatus] = mapped_column(
        Enum(
            RequestStatus,
            native_enum=False,
            length=16,
            name="request_status",
            values_callable=lambda members: [m.value for m in members],
        )
    )
    stream: Mapped[bool] = mapped_column(Boolean)
    user: Mapped[str | None] = mapped_column(String(256))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    max_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    # Response-length prediction (the predictor fills these; null while none is configured).
    predicted_tokens: Mapped[int | None] = mapped_column(Integer)
    predicted_bucket: Mapped[int | None] = mapped_column(Integer)
    predictor_version: Mapped[str | None] = mapped_column(String(64))
    predicted_p90_tokens: Mapped[int | None] = mapped_column(Integer)
    routing_policy: Mapped[str] = mapped_column(String(32))
    # Why this site: {"survivors": [[filter, count], ...], "scores": {site: score}, "planned":
    # answer tokens routing planned with}; lets the dashboard and offline analysis explain it.
    routing_detail: Mapped[dict[str, object] | None] = mapped_column(JSON)
    site_id: Mapped[int | None] = mapped_column(ForeignKey("sites.id", ondelete="SET NULL"))
    # The API key that made the request (null: keys not required and none sent), for usage.
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    # An answer that continued on other sites after its site failed mid-stream:
    # [{"from": site, "to": site, "after_tokens": n}, ...] (null: it stayed on one site).
    continuations: Mapped[list[dict[str, object]] | None] = mapped_column(JSON(none_as_null=True))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    site: Mapped[Site | None] = relationship(back_populates="requests")


class LengthSample(Base):
    """What the predictor learns from: a prompt and how long the answer really was.

    `censored` marks answers cut by max_tokens (or the context): their true length is only known
    to be at least `completion_tokens`.
    """

    __tablename__ = "length_samples"
    __table_args__ = (Index("ix_length_samples_model_created_at", "model", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(
        ForeignKey("requests.id", ondelete="CASCADE"), unique=True
    )
    model: Mapped[str] = mapped_column(String(128))
    prompt: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    censored: Mapped[bool] = mapped_column(Boolean)
    predicted_tokens: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class OffloadEvent(Base):
    """A queued request that a busy site handed back and another site took over."""

    __tablename__ = "offload_events"
    __table_args__ = (Index("ix_offload_events_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"))
    from_site_id: Mapped[int | None] = mapped_column(ForeignKey("sites.id", ondelete="SET NULL"))
    to_site_id: Mapped[int | None] = mapped_column(ForeignKey("sites.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
