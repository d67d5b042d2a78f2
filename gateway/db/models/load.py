"""Per-site load samples and their rollups (the dashboard's history)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, Float, ForeignKey, Index, Integer
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import Base, UTCDateTime


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
