"""per-site load history: samples and their 5-minute rollups

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-21 12:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "load_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("bucket_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("queued_tokens", sa.Integer(), nullable=False),
        sa.Column("running_tokens", sa.Integer(), nullable=False),
        sa.Column("predicted_remaining_tokens", sa.Integer(), nullable=False),
        sa.Column("queued_requests", sa.Integer(), nullable=False),
        sa.Column("running_requests", sa.Integer(), nullable=False),
        sa.Column("completed_requests", sa.Integer(), nullable=False),
        sa.Column("ttft_mean_ms", sa.Float(), nullable=True),
        sa.Column("ttft_p50_ms", sa.Float(), nullable=True),
        sa.Column("e2e_mean_ms", sa.Float(), nullable=True),
        sa.Column("e2e_p50_ms", sa.Float(), nullable=True),
        sa.Column("healthy", sa.Boolean(), nullable=False),
        foreign_key("load_samples", "site_id", "sites", "CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_load_samples")),
    )
    with op.batch_alter_table("load_samples", schema=None) as batch_op:
        batch_op.create_index("ix_load_samples_bucket_at", ["bucket_at"], unique=False)
        batch_op.create_index(
            "ix_load_samples_site_id_bucket_at", ["site_id", "bucket_at"], unique=False
        )

    op.create_table(
        "load_rollups",
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("period_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("queued_tokens_sum", sa.BigInteger(), nullable=False),
        sa.Column("running_tokens_sum", sa.BigInteger(), nullable=False),
        sa.Column("predicted_remaining_tokens_sum", sa.BigInteger(), nullable=False),
        sa.Column("queued_requests_sum", sa.BigInteger(), nullable=False),
        sa.Column("running_requests_sum", sa.BigInteger(), nullable=False),
        sa.Column("completed_requests", sa.Integer(), nullable=False),
        sa.Column("ttft_ms_weighted", sa.Float(), nullable=False),
        sa.Column("ttft_weight", sa.Integer(), nullable=False),
        sa.Column("e2e_ms_weighted", sa.Float(), nullable=False),
        sa.Column("e2e_weight", sa.Integer(), nullable=False),
        sa.Column("healthy_samples", sa.Integer(), nullable=False),
        foreign_key("load_rollups", "site_id", "sites", "CASCADE"),
        sa.PrimaryKeyConstraint("site_id", "period_at", name=op.f("pk_load_rollups")),
    )
    with op.batch_alter_table("load_rollups", schema=None) as batch_op:
        batch_op.create_index("ix_load_rollups_period_at", ["period_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("load_rollups", schema=None) as batch_op:
        batch_op.drop_index("ix_load_rollups_period_at")

    op.drop_table("load_rollups")
    with op.batch_alter_table("load_samples", schema=None) as batch_op:
        batch_op.drop_index("ix_load_samples_site_id_bucket_at")
        batch_op.drop_index("ix_load_samples_bucket_at")

    op.drop_table("load_samples")
