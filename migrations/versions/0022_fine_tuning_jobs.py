"""fine_tuning_jobs, fine_tuning_events, fine_tuning_checkpoints: the fine-tuning API

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-26 16:00:00.000000

Issue 54: LoRA fine-tuning jobs (POST /v1/fine_tuning/jobs), each its key's own, trained on a
site and polled by the gateway (gateway/fine_tuning/runner.py); their events (status changes and
per-step metrics) and the checkpoints their site wrote. All go with their key, and events and
checkpoints with their job.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import foreign_key

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


def upgrade() -> None:
    op.create_table(
        "fine_tuning_jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("owner_key_name", sa.String(length=128), nullable=True),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("training_file", sa.String(length=64), nullable=False),
        sa.Column("validation_file", sa.String(length=64), nullable=True),
        sa.Column("suffix", sa.String(length=64), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("n_epochs", sa.Integer(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("learning_rate_multiplier", sa.Float(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(*_STATUSES, name="fine_tuning_status", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("site", sa.String(length=128), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("trained_tokens", sa.BigInteger(), nullable=False),
        sa.Column("reported_step", sa.Integer(), nullable=False),
        sa.Column("adapter_path", sa.Text(), nullable=True),
        sa.Column("fine_tuned_model", sa.String(length=256), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        foreign_key("fine_tuning_jobs", "api_key_id", "api_keys", "CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fine_tuning_jobs")),
    )
    with op.batch_alter_table("fine_tuning_jobs", schema=None) as batch_op:
        batch_op.create_index(
            "ix_fine_tuning_jobs_api_key_id_created_at", ["api_key_id", "created_at"]
        )
        batch_op.create_index("ix_fine_tuning_jobs_status", ["status"])
    op.create_table(
        "fine_tuning_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("level", sa.String(length=8), nullable=False),
        sa.Column("type", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        foreign_key("fine_tuning_events", "job_id", "fine_tuning_jobs", "CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fine_tuning_events")),
    )
    with op.batch_alter_table("fine_tuning_events", schema=None) as batch_op:
        batch_op.create_index("ix_fine_tuning_events_job_id_id", ["job_id", "id"])
    op.create_table(
        "fine_tuning_checkpoints",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("train_loss", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        foreign_key("fine_tuning_checkpoints", "job_id", "fine_tuning_jobs", "CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fine_tuning_checkpoints")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_fine_tuning_checkpoints_job_id")),
    )


def downgrade() -> None:
    op.drop_table("fine_tuning_checkpoints")
    with op.batch_alter_table("fine_tuning_events", schema=None) as batch_op:
        batch_op.drop_index("ix_fine_tuning_events_job_id_id")
    op.drop_table("fine_tuning_events")
    with op.batch_alter_table("fine_tuning_jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_fine_tuning_jobs_status")
        batch_op.drop_index("ix_fine_tuning_jobs_api_key_id_created_at")
    op.drop_table("fine_tuning_jobs")
