"""key margins: what a key's unsettled requests may still take beyond their charges

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-24 12:00:00.000000

A request is charged its prompt plus its predicted answer; it may take up to its prompt plus
max_tokens. The difference is its margin, held by its key until the request is settled, so that
admission can bound what under-predicted requests overshoot a key's tokens per minute by
(gateway/tenancy/limiter.py). Kept per key (checked on admission) and per gateway (handed back
with the gateway's slots when it stops renewing them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("key_limit_windows", "key_in_flight_holds")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(
                sa.Column("margin", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
            )


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("margin")
