"""requests.adapter: the LoRA adapter a request was for

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26 13:30:00.000000

Issue 51: a request's `model` may name a LoRA adapter served over a base model. The row keeps
the base in `model` (usage per model, the predictor's samples and the dashboards group by it as
before) and the adapter beside it; NULL for the base itself and for every row before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("adapter", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_column("adapter")
