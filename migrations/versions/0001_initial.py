"""initial schema: sites and requests

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-21 00:36:55.612177
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sites",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("cloud", sa.String(length=32), nullable=False),
        sa.Column("region", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=256), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("capacity_weight", sa.Float(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sites")),
        sa.UniqueConstraint("name", name=op.f("uq_sites_name")),
    )
    op.create_table(
        "requests",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("api", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "dispatched",
                "completed",
                "failed",
                "cancelled",
                name="request_status",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("user", sa.String(length=256), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.String(length=16), nullable=True),
        sa.Column("predicted_tokens", sa.Integer(), nullable=True),
        sa.Column("predicted_bucket", sa.Integer(), nullable=True),
        sa.Column("predictor_version", sa.String(length=64), nullable=True),
        sa.Column("routing_policy", sa.String(length=32), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("first_token_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        foreign_key("requests", "site_id", "sites", "SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
    )
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.create_index("ix_requests_created_at", ["created_at"], unique=False)
        batch_op.create_index(
            "ix_requests_site_id_created_at", ["site_id", "created_at"], unique=False
        )
        batch_op.create_index("ix_requests_status", ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index("ix_requests_status")
        batch_op.drop_index("ix_requests_site_id_created_at")
        batch_op.drop_index("ix_requests_created_at")

    op.drop_table("requests")
    op.drop_table("sites")
