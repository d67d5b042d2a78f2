"""scaling_events: the arrival rate, lead and smoothed backlog a decision was made on

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-26 16:00:00.000000

Issue 53: the controller scales out on the predicted work arriving per second a measured site
start ahead, and in on the backlog's time-weighted mean over a window. A decision's row keeps
those inputs beside the backlog and forecast it already had; NULL for the rows before and for
events that are no decision (joins, leaves).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("arrival_rate", "lead_s", "smoothed_backlog_s")


def upgrade() -> None:
    with op.batch_alter_table("scaling_events", schema=None) as batch_op:
        for name in _COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("scaling_events", schema=None) as batch_op:
        for name in reversed(_COLUMNS):
            batch_op.drop_column(name)
