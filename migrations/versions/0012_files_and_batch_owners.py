"""files, and batches owned by their key in OpenAI's shape

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-23 09:00:00.000000

Batches get the key that created them (every batch query is scoped to it), the endpoint their
items are requests of, their input file, completion window and expiry, a finalizing time and
their output and error files; items get the HTTP status of a failure. `files` and `file_parts`
hold the Files API's uploads and the batches' result files. Batches made before this revision
have no key: only callers without a key see them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.conventions import add_foreign_key, foreign_key

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BATCH_TIMES = ("expires_at", "expired_at", "finalizing_at")


def upgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("api_key_id", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column(
                "endpoint",
                sa.String(length=32),
                nullable=False,
                server_default="/v1/completions",
            )
        )
        batch_op.add_column(sa.Column("input_file_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("completion_window", sa.String(length=16), nullable=True))
        for name in _BATCH_TIMES:
            batch_op.add_column(sa.Column(name, sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("output_file_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("error_file_id", sa.String(length=64), nullable=True))
        add_foreign_key(batch_op, "batches", "api_key_id", "api_keys", "SET NULL")
        batch_op.create_index(
            "ix_batches_api_key_id_created_at", ["api_key_id", "created_at"], unique=False
        )
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("status_code", sa.Integer(), nullable=True))

    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        foreign_key("files", "api_key_id", "api_keys", "SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index(
            "ix_files_api_key_id_created_at", ["api_key_id", "created_at"], unique=False
        )
        batch_op.create_index("ix_files_expires_at", ["expires_at"], unique=False)
    op.create_table(
        "file_parts",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        foreign_key("file_parts", "file_id", "files", "CASCADE"),
        sa.PrimaryKeyConstraint("file_id", "seq", name=op.f("pk_file_parts")),
    )


def downgrade() -> None:
    op.drop_table("file_parts")
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index("ix_files_expires_at")
        batch_op.drop_index("ix_files_api_key_id_created_at")
    op.drop_table("files")
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.drop_column("status_code")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_api_key_id_created_at")
        batch_op.drop_constraint(batch_op.f("fk_batches_api_key_id_api_keys"), type_="foreignkey")
        for name in ("error_file_id", "output_file_id", *reversed(_BATCH_TIMES)):
            batch_op.drop_column(name)
        for name in ("completion_window", "input_file_id", "endpoint", "api_key_id"):
            batch_op.drop_column(name)
