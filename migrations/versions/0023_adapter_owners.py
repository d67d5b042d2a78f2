"""adapter_owners: who may use a LoRA adapter loaded at run time, by API key id

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-27 00:00:00.000000

Issue 58: an adapter loaded through the admin API with an owner key was private only in the
memory of the gateway that loaded it, and owners were key names (which repeat). Every adapter
loaded at run time and every fine-tuned model now has a row here, read by every gateway of the
database; a served adapter without one (and not in the federation file) is nobody's. The
fine-tuned models of jobs that succeeded before get theirs from their jobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter_owners",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("parent", sa.String(length=128), nullable=False),
        sa.Column("public", sa.Boolean(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        foreign_key("adapter_owners", "api_key_id", "api_keys", "CASCADE"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_adapter_owners")),
    )
    op.execute(
        "INSERT INTO adapter_owners (name, parent, public, api_key_id, created_at) "
        "SELECT fine_tuned_model, model, false, api_key_id, COALESCE(finished_at, created_at) "
        "FROM fine_tuning_jobs WHERE status = 'succeeded' AND fine_tuned_model IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_table("adapter_owners")
