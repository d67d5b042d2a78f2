"""batch_items.plan_rank: where the batch plan puts each item in its site's order

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26 12:15:00.000000

Issue 52: the order a batch's items start in is decided once, by the batch plan
(gateway/batches/plan.py: longest first, depth-first prefix or BlendServe's resource-aware prefix
tree), and the store only persists it. Before, the order was written twice (SQL in the store
and Python in its records). Items of batches already accepted keep their submission order.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("plan_rank", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
    op.execute("UPDATE batch_items SET plan_rank = item_index")
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.create_index(
            "ix_batch_items_batch_id_site_id_plan_rank",
            ["batch_id", "site_id", "plan_rank"],
            unique=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.drop_index("ix_batch_items_batch_id_site_id_plan_rank")
        batch_op.drop_column("plan_rank")
