"""The gateway's database schema (SQLAlchemy 2 ORM). Wire schemas live in gateway/api/schemas.py.

Postgres in production, SQLite as the embedded default: only portable types are used, enums are
stored as checked strings, and timestamps are always timezone-aware UTC.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Deterministic constraint names, so migrations can address them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores UTC, returns aware datetimes: SQLite would otherwise hand back naive ones."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


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


class OffloadEvent(Base):
    """A queued request that a busy site handed back and another site took over."""

    __tablename__ = "offload_events"
    __table_args__ = (Index("ix_offload_events_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"))
    from_site_id: Mapped[int | None] = mapped_column(ForeignKey("sites.id", ondelete="SET NULL"))
    to_site_id: Mapped[int | None] = mapped_column(ForeignKey("sites.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"  # accepted; lengths being predicted and sites assigned
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"  # every item final and at least one completed
    FAILED = "failed"  # every item final and none completed
    CANCELLING = "cancelling"  # cancel asked; running items are being stopped
    CANCELLED = "cancelled"


class BatchItemStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


def _checked_enum(enum_type: type[enum.StrEnum], name: str) -> Enum:
    return Enum(
        enum_type,
        native_enum=False,
        length=16,
        name=name,
        values_callable=lambda members: [m.value for m in members],
    )


class BatchJob(Base):
    """An offline batch (POST /v1/batches): its counters are updated in the same transaction as
    the item that moves them, so they always agree with batch_items."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_created_at", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    status: Mapped[BatchStatus] = mapped_column(_checked_enum(BatchStatus, "batch_status"))
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
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class BatchItem(Base):
    """One request of a batch: what was asked, where MICO assigned it and why, and its result.

    `attempts` counts starts and fences results: a result is written only by the attempt that
    started the item last, so an item recorded final is never run or written again.
    """

    __tablename__ = "batch_items"
    __table_args__ = (
        Index("ix_batch_items_batch_id_custom_id", "batch_id", "custom_id", unique=True),
        Index("ix_batch_items_batch_id_status", "batch_id", "status"),
    )

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    item_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    custom_id: Mapped[str] = mapped_column(String(256))
    # The item as submitted, less custom_id: validated again at each start.
    body: Mapped[dict[str, object]] = mapped_column(JSON)
    status: Mapped[BatchItemStatus] = mapped_column(
        _checked_enum(BatchItemStatus, "batch_item_status")
    )
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    max_tokens: Mapped[int] = mapped_column(Integer)
    predicted_tokens: Mapped[int | None] = mapped_column(Integer)
    predicted_bucket: Mapped[int | None] = mapped_column(Integer)
    predictor_version: Mapped[str | None] = mapped_column(String(64))
    site_id: Mapped[int | None] = mapped_column(ForeignKey("sites.id", ondelete="SET NULL"))
    assign_reason: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # The request of the latest attempt (its row in `requests` is written by the request log).
    request_id: Mapped[str | None] = mapped_column(String(64))
    completion: Mapped[dict[str, object] | None] = mapped_column(JSON)
    error: Mapped[dict[str, object] | None] = mapped_column(JSON)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class LoadSample(Base):
    """One site's load at one sampler tick (the admin dashboard's history).

    Token and request gauges are the gateway's live view at `bucket_at`; `completed_requests` and
    the latencies cover the requests that finished on the site since the previous tick (null
    latencies: none finished). Rows older than the retention setting are deleted by the sampler.
    """

    __tablename__ = "load_samples"
    __table_args__ = (
        Index("ix_load_samples_bucket_at", "bucket_at"),
        Index("ix_load_samples_site_id_bucket_at", "site_id", "bucket_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"))
    bucket_at: Mapped[datetime] = mapped_column(UTCDateTime())
    queued_tokens: Mapped[int] = mapped_column(Integer)
    running_tokens: Mapped[int] = mapped_column(Integer)
    predicted_remaining_tokens: Mapped[int] = mapped_column(Integer)
    queued_requests: Mapped[int] = mapped_column(Integer)
    running_requests: Mapped[int] = mapped_column(Integer)
    completed_requests: Mapped[int] = mapped_column(Integer)
    ttft_mean_ms: Mapped[float | None] = mapped_column(Float)
    ttft_p50_ms: Mapped[float | None] = mapped_column(Float)
    e2e_mean_ms: Mapped[float | None] = mapped_column(Float)
    e2e_p50_ms: Mapped[float | None] = mapped_column(Float)
    healthy: Mapped[bool] = mapped_column(Boolean)


class LoadRollup(Base):
    """One site's load samples of one 5-minute period, summed (the sampler writes it once the
    period is over): a day of history reads 288 of these per site instead of 8640 samples."""

    __tablename__ = "load_rollups"
    __table_args__ = (Index("ix_load_rollups_period_at", "period_at"),)

    site_id: Mapped[int] = mapped_column(
        ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True
    )
    period_at: Mapped[datetime] = mapped_column(UTCDateTime(), primary_key=True)
    samples: Mapped[int] = mapped_column(Integer)
    queued_tokens_sum: Mapped[int] = mapped_column(BigInteger)
    running_tokens_sum: Mapped[int] = mapped_column(BigInteger)
    predicted_remaining_tokens_sum: Mapped[int] = mapped_column(BigInteger)
    queued_requests_sum: Mapped[int] = mapped_column(BigInteger)
    running_requests_sum: Mapped[int] = mapped_column(BigInteger)
    completed_requests: Mapped[int] = mapped_column(Integer)
    # Latency means weighted by the completions they cover, and those completions.
    ttft_ms_weighted: Mapped[float] = mapped_column(Float)
    ttft_weight: Mapped[int] = mapped_column(Integer)
    e2e_ms_weighted: Mapped[float] = mapped_column(Float)
    e2e_weight: Mapped[int] = mapped_column(Integer)
    healthy_samples: Mapped[int] = mapped_column(Integer)


class ApiKey(Base):
    """A client API key. Only a SHA-256 of the key is stored (and a short prefix to recognise it
    by); revoked keys stay, so past usage keeps its key."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # Per-minute limits; null is unlimited.
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    # Requests of the key in flight at once (per gateway); null is unlimited.
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class IdempotencyStatus(enum.StrEnum):
    RUNNING = "running"  # the first request with the key is being served
    COMPLETED = "completed"  # its response is stored and answers retries


class IdempotencyRecord(Base):
    """A client's Idempotency-Key: the request it first came with (a hash of endpoint and body)
    and, once that request succeeded, its response, which retries with the key get back.

    Keys are scoped by API key ("key:<id>", or "anonymous" without one), so one client's keys
    never meet another's."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (
        UniqueConstraint("scope", "key", name="uq_idempotency_keys_scope_key"),
        Index("ix_idempotency_keys_expires_at", "expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    scope: Mapped[str] = mapped_column(String(32))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[IdempotencyStatus] = mapped_column(
        Enum(
            IdempotencyStatus,
            native_enum=False,
            length=16,
            name="idempotency_status",
            values_callable=lambda members: [m.value for m in members],
        )
    )
    response_status: Mapped[int | None] = mapped_column(Integer)
    response_body: Mapped[bytes | None] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AdminSession(Base):
    """A dashboard sign-in. The cookie carries the id, its issue time and an HMAC of both under
    the admin token; this row makes the session revocable (logout) on every gateway sharing the
    database, and bounds it in time on the server whatever the browser keeps."""

    __tablename__ = "admin_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
