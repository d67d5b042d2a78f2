"""scaling_events: the scaling controller's decisions and sites joining and leaving

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 10:00:00.000000

`scaling_events` keeps each decision of the scaling controller (gateway/scaling/), what its
actuator did, and every site that joined or left at run time, for the dashboard and for audit.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "scaling_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("site", sa.String(length=128), nullable=True),
        sa.Column("actor", sa.String(length=32), nullable=False),
        sa.Column("serving_sites", sa.Integer(), nullable=False),
        sa.Column("desired_sites", sa.Integer(), nullable=False),
        sa.Column("backlog_s", sa.Float(), nullable=True),
        sa.Column("forecast_backlog_s", sa.Float(), nullable=True),
        sa.Column("reason", sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scaling_events")),
    )
    with op.batch_alter_table("scaling_events", schema=None) as batch_op:
        batch_op.create_index("ix_scaling_events_created_at", ["created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("scaling_events", schema=None) as batch_op:
        batch_op.drop_index("ix_scaling_events_created_at")
    op.drop_table("scaling_events")
