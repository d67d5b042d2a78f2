"""offload events

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 01:56:51.031355
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "offload_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("from_site_id", sa.Integer(), nullable=True),
        sa.Column("to_site_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        foreign_key("offload_events", "from_site_id", "sites", "SET NULL"),
        foreign_key("offload_events", "request_id", "requests", "CASCADE"),
        foreign_key("offload_events", "to_site_id", "sites", "SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_offload_events")),
    )
    with op.batch_alter_table("offload_events", schema=None) as batch_op:
        batch_op.create_index("ix_offload_events_created_at", ["created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("offload_events", schema=None) as batch_op:
        batch_op.drop_index("ix_offload_events_created_at")

    op.drop_table("offload_events")
