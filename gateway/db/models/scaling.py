"""What the scaling controller decided and what came of it, and sites joining and leaving."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Float, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import Base, UTCDateTime, utcnow


class ScalingEvent(Base):
    """One event of a model's capacity (gateway/scaling/): a decision (`scale_out`, `scale_in`),
    what an actuator did (`start_failed`), or a site joining or leaving (`join`, `leave`, by the
    controller or an operator). Names, not ids: a site that never joined (a start that failed)
    has no row in `sites`."""

    __tablename__ = "scaling_events"
    __table_args__ = (Index("ix_scaling_events_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    model: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(16))
    # The site it concerns (a scale-out names none: the actuator names what it starts).
    site: Mapped[str | None] = mapped_column(String(128))
    # Who: "controller", "operator", or the actuator ("local", "kubernetes").
    actor: Mapped[str] = mapped_column(String(32))
    # The model's sites serving when it happened, and the number the controller wants.
    serving_sites: Mapped[int] = mapped_column(Integer)
    desired_sites: Mapped[int] = mapped_column(Integer)
    # Seconds of predicted work per serving site, now and as forecast over the lead time.
    backlog_s: Mapped[float | None] = mapped_column(Float)
    forecast_backlog_s: Mapped[float | None] = mapped_column(Float)
    # A decision's other inputs: predicted work arriving (seconds of a site's time per second),
    # how far ahead the forecast looked, and the backlog per serving site over the window.
    arrival_rate: Mapped[float | None] = mapped_column(Float)
    lead_s: Mapped[float | None] = mapped_column(Float)
    smoothed_backlog_s: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(String(256))
