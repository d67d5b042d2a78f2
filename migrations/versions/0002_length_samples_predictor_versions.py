"""length samples and predictor versions

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 01:02:58.084614
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "predictor_versions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("scheme", sa.String(length=64), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("activated_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_predictor_versions")),
        sa.UniqueConstraint("version", name=op.f("uq_predictor_versions_version")),
    )
    op.create_table(
        "length_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("censored", sa.Boolean(), nullable=False),
        sa.Column("predicted_tokens", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        foreign_key("length_samples", "request_id", "requests", "CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_length_samples")),
        sa.UniqueConstraint("request_id", name=op.f("uq_length_samples_request_id")),
    )
    with op.batch_alter_table("length_samples", schema=None) as batch_op:
        batch_op.create_index(
            "ix_length_samples_model_created_at", ["model", "created_at"], unique=False
        )

    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("predicted_p90_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_column("predicted_p90_tokens")

    with op.batch_alter_table("length_samples", schema=None) as batch_op:
        batch_op.drop_index("ix_length_samples_model_created_at")

    op.drop_table("length_samples")
    op.drop_table("predictor_versions")
