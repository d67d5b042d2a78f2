"""Stored responses of the Responses API (POST /v1/responses with `store` left on)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import Base, UTCDateTime, utcnow


class StoredResponse(Base):
    """One response as its client was answered, with what a follow-up (`previous_response_id`)
    continues from: the items before its own input (its earlier responses' whole conversation)
    and its input. A follow-up then reads one row, however long the conversation: the row is
    bounded by the model's context, which the conversation had to fit.

    It belongs to one key (null: made without a key, seen only by callers without one) and goes
    with its key; it is deleted once `expires_at` passes (GATEWAY_RESPONSE_RETENTION_H)."""

    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_expires_at", "expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # The `response` object as answered (its output items included).
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    # This request's own input items, in the API's canonical shapes.
    input_items: Mapped[list[Any]] = mapped_column(JSON)
    # The items before them: the earlier responses' inputs and outputs, oldest first.
    history: Mapped[list[Any]] = mapped_column(JSON)
