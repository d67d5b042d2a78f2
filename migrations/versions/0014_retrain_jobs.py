"""retrain jobs: adapting a model's predictor when an operator or the drift signal asks

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-23 12:00:00.000000

One row per job: who asked (manual or drift), its state (queued, running, done, failed), its
times, the version it registered and the activation gate's decision. A partial unique index lets
each model have at most one open (queued or running) job, for every gateway of the database.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OPEN_JOB = sa.text("state IN ('queued', 'running')")


def upgrade() -> None:
    op.create_table(
        "retrain_jobs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "queued",
                "running",
                "done",
                "failed",
                name="job_state",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("drift", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("version", sa.String(length=64), nullable=True),
        sa.Column("activated", sa.Boolean(), nullable=True),
        sa.Column("decision", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_retrain_jobs")),
    )
    op.create_index("ix_retrain_jobs_model_created_at", "retrain_jobs", ["model", "created_at"])
    op.create_index(
        "uq_retrain_jobs_open_model",
        "retrain_jobs",
        ["model"],
        unique=True,
        postgresql_where=OPEN_JOB,
        sqlite_where=OPEN_JOB,
    )


def downgrade() -> None:
    op.drop_index("uq_retrain_jobs_open_model", table_name="retrain_jobs")
    op.drop_index("ix_retrain_jobs_model_created_at", table_name="retrain_jobs")
    op.drop_table("retrain_jobs")
