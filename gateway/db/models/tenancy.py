"""API keys, their limits and idempotency records, and admin sessions."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Enum,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import Base, UTCDateTime, utcnow


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


# A key's counts per second on PostgreSQL (an array); SQLite, whose gateway counts in memory,
# only has the column.
SecondCounts = JSON().with_variant(ARRAY(BigInteger), "postgresql")


class KeyLimitWindow(Base):
    """A key's usage over the last minute and requests in flight, shared by every gateway of a
    PostgreSQL database (gateway/tenancy/shared_limits.py): the requests and tokens charged in
    each of the last 61 seconds (gateway/tenancy/second_windows.py). SQLite (one gateway) keeps
    these in memory instead."""

    __tablename__ = "key_limit_windows"

    api_key_id: Mapped[int] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True
    )
    # The Unix second counted in the last element of `second_requests` and `second_tokens`
    # (oldest first).
    bucket: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    second_requests: Mapped[list[int]] = mapped_column(SecondCounts)
    second_tokens: Mapped[list[int]] = mapped_column(SecondCounts)
    # Requests of the key in flight on every gateway together (the sum of its holds).
    in_flight: Mapped[int] = mapped_column(Integer)
    # What the key's unsettled requests may still take beyond their charges (prompt +
    # max_tokens less prompt + prediction), on every gateway together (the sum of its holds).
    margin: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # The clock-minute counters of gateways before revision 0016, which a rolling upgrade may
    # still run beside newer ones (they count their charges there, the newer ones in seconds;
    # both share in_flight and margin). A later revision drops them.
    minute: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    requests: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    previous_requests: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    previous_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))


class KeyInFlightHold(Base):
    """One gateway's share of a key's requests in flight. A gateway renews its holds while it
    lives; the holds of one that stopped renewing (it crashed) are handed back by the others,
    so a dead gateway cannot keep a key at its concurrency cap."""

    __tablename__ = "key_in_flight_holds"

    api_key_id: Mapped[int] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True
    )
    gateway_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    in_flight: Mapped[int] = mapped_column(Integer)
    margin: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)


class AdminLoginFailure(Base):
    """A failed dashboard sign-in: the login throttle counts them per client address over a
    sliding window, on every gateway of the database together."""

    __tablename__ = "admin_login_failures"
    __table_args__ = (Index("ix_admin_login_failures_address_failed_at", "address", "failed_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    address: Mapped[str] = mapped_column(String(64))
    failed_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)


class AdapterOwner(Base):
    """Who may use a LoRA adapter loaded at run time (the admin API, or a fine-tuning job's
    trained model), kept here so that every gateway of the database and a restarted one know
    it: a site lists adapters by name only, and a served adapter no row (nor the federation
    file) declares is nobody's."""

    __tablename__ = "adapter_owners"

    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    parent: Mapped[str] = mapped_column(String(128))  # its base model
    # Every key's; otherwise only `api_key_id`'s (null: callers without a key).
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    # By id, not name (names repeat); a deleted key takes its private adapters' rows with it,
    # and they fall back to nobody's.
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
