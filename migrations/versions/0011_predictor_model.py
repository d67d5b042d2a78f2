"""predictor versions: keyed by the served model they predict

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-22 14:00:00.000000

Each served model has its own active predictor version; '' is the default, serving every model
without its own (what every version registered before this revision was).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("predictor_versions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("model", sa.String(length=128), nullable=False, server_default="")
        )
        batch_op.create_index("ix_predictor_versions_model_active", ["model", "active"])


def downgrade() -> None:
    with op.batch_alter_table("predictor_versions", schema=None) as batch_op:
        batch_op.drop_index("ix_predictor_versions_model_active")
        batch_op.drop_column("model")
