"""client API keys, and the key of each request

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-21 13:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import add_foreign_key

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    # Batch mode: SQLite cannot add a foreign key to an existing table in place.
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("api_key_id", sa.Integer(), nullable=True))
        add_foreign_key(batch_op, "requests", "api_key_id", "api_keys", "SET NULL")
        batch_op.create_index(
            "ix_requests_api_key_id_created_at", ["api_key_id", "created_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index("ix_requests_api_key_id_created_at")
        batch_op.drop_constraint(op.f("fk_requests_api_key_id_api_keys"), type_="foreignkey")
        batch_op.drop_column("api_key_id")
    op.drop_table("api_keys")
