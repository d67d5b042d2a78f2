"""per-key limits and the admin login throttle shared by every gateway of the database

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-23 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "key_limit_windows",
        sa.Column("api_key_id", sa.Integer(), nullable=False),
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("previous_requests", sa.BigInteger(), nullable=False),
        sa.Column("previous_tokens", sa.BigInteger(), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        foreign_key("key_limit_windows", "api_key_id", "api_keys", "CASCADE"),
        sa.PrimaryKeyConstraint("api_key_id", name=op.f("pk_key_limit_windows")),
    )
    op.create_table(
        "key_in_flight_holds",
        sa.Column("api_key_id", sa.Integer(), nullable=False),
        sa.Column("gateway_id", sa.String(length=32), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        foreign_key("key_in_flight_holds", "api_key_id", "api_keys", "CASCADE"),
        sa.PrimaryKeyConstraint("api_key_id", "gateway_id", name=op.f("pk_key_in_flight_holds")),
    )
    with op.batch_alter_table("key_in_flight_holds", schema=None) as batch_op:
        batch_op.create_index("ix_key_in_flight_holds_renewed_at", ["renewed_at"], unique=False)
    op.create_table(
        "admin_login_failures",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("address", sa.String(length=64), nullable=False),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_login_failures")),
    )
    with op.batch_alter_table("admin_login_failures", schema=None) as batch_op:
        batch_op.create_index(
            "ix_admin_login_failures_address_failed_at", ["address", "failed_at"], unique=False
        )
        batch_op.create_index("ix_admin_login_failures_failed_at", ["failed_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("admin_login_failures", schema=None) as batch_op:
        batch_op.drop_index("ix_admin_login_failures_failed_at")
        batch_op.drop_index("ix_admin_login_failures_address_failed_at")
    op.drop_table("admin_login_failures")
    with op.batch_alter_table("key_in_flight_holds", schema=None) as batch_op:
        batch_op.drop_index("ix_key_in_flight_holds_renewed_at")
    op.drop_table("key_in_flight_holds")
    op.drop_table("key_limit_windows")
