"""batches and batch items

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-21 03:10:12.402211
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "validating",
                "in_progress",
                "completed",
                "failed",
                "cancelling",
                "cancelled",
                name="batch_status",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("cancelled", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("in_progress_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelling_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.create_index("ix_batches_created_at", ["created_at"], unique=False)
        batch_op.create_index("ix_batches_status", ["status"], unique=False)

    op.create_table(
        "batch_items",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("item_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("custom_id", sa.String(length=256), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "queued",
                "running",
                "completed",
                "failed",
                "cancelled",
                name="batch_item_status",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("predicted_tokens", sa.Integer(), nullable=True),
        sa.Column("predicted_bucket", sa.Integer(), nullable=True),
        sa.Column("predictor_version", sa.String(length=64), nullable=True),
        sa.Column("site_id", sa.Integer(), nullable=True),
        sa.Column("assign_reason", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=True),
        sa.Column("completion", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        foreign_key("batch_items", "batch_id", "batches", "CASCADE"),
        foreign_key("batch_items", "site_id", "sites", "SET NULL"),
        sa.PrimaryKeyConstraint("batch_id", "item_index", name=op.f("pk_batch_items")),
    )
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.create_index(
            "ix_batch_items_batch_id_custom_id", ["batch_id", "custom_id"], unique=True
        )
        batch_op.create_index(
            "ix_batch_items_batch_id_status", ["batch_id", "status"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.drop_index("ix_batch_items_batch_id_status")
        batch_op.drop_index("ix_batch_items_batch_id_custom_id")

    op.drop_table("batch_items")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_status")
        batch_op.drop_index("ix_batches_created_at")

    op.drop_table("batches")
