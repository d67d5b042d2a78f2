"""responses: stored responses of the Responses API

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 09:00:00.000000

`responses` keeps each response made with `store` on: the object its client was answered, its
input items and the conversation before them (so that `previous_response_id` reads one row),
owned by the key that made it (and deleted with it) until it expires.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("history", sa.JSON(), nullable=False),
        foreign_key("responses", "api_key_id", "api_keys", "CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
    )
    with op.batch_alter_table("responses", schema=None) as batch_op:
        batch_op.create_index("ix_responses_expires_at", ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("responses", schema=None) as batch_op:
        batch_op.drop_index("ix_responses_expires_at")
    op.drop_table("responses")
