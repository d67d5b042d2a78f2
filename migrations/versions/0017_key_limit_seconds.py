"""key limits counted per second: a sliding minute of 61 one-second counts per key

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26 09:00:00.000000

Issue 48, finding 2: the shared limits counted clock minutes and estimated the sliding minute
from this one and the weighted previous one, which let a key through 1.6-1.9x its limit over a
minute boundary. Each key's row now holds the requests and tokens of each of the last 61
seconds (gateway/tenancy/second_windows.py), in arrays (PostgreSQL; SQLite counts in memory and
only has the columns). The current minute's counts carry over, as if charged in its last second.

The minute columns stay, defaulted, for gateways of the previous revision that a rolling upgrade
still runs: they count their charges there while newer ones count in seconds, and both share the
concurrency slots and margins. A later revision drops them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BUCKETS = 61
LEGACY = ("minute", "requests", "tokens", "previous_requests", "previous_tokens")
NEW = ("bucket", "second_requests", "second_tokens")


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    counts: sa.types.TypeEngine[object] = (
        postgresql.ARRAY(sa.BigInteger()) if postgres else sa.JSON()  # type: ignore[assignment]
    )
    empty = sa.text(f"array_fill(0::bigint, ARRAY[{BUCKETS}])" if postgres else "'[]'")
    with op.batch_alter_table("key_limit_windows", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("bucket", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
        )
        for column in ("second_requests", "second_tokens"):
            batch_op.add_column(sa.Column(column, counts, server_default=empty, nullable=False))
        for column in LEGACY:
            batch_op.alter_column(column, server_default=sa.text("0"))
    if postgres:
        op.execute(
            "UPDATE key_limit_windows SET bucket = minute * 60 + 59, "
            f"second_requests = array_fill(0::bigint, ARRAY[{BUCKETS - 1}]) || requests, "
            f"second_tokens = array_fill(0::bigint, ARRAY[{BUCKETS - 1}]) || tokens"
        )


def downgrade() -> None:
    with op.batch_alter_table("key_limit_windows", schema=None) as batch_op:
        for column in LEGACY:
            batch_op.alter_column(column, server_default=None)
        for column in reversed(NEW):
            batch_op.drop_column(column)
