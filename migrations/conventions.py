"""Foreign keys as the revisions create them: on a referred table's `id`, named by the models'
naming convention (gateway/db/models/base.py, "fk"), so that each name is the one the ORM
metadata gives (tests/integration/test_migrations.py compares the two schemas).

A revision's effect must never change once released: whatever is added here is new, and what is
here stays as it is."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from alembic.operations import BatchOperations


def fk_name(table: str, column: str, referred: str) -> str:
    return f"fk_{table}_{column}_{referred}"


def foreign_key(table: str, column: str, referred: str, ondelete: str) -> sa.ForeignKeyConstraint:
    """`table`.`column` referring to `referred`.id, for a table being created."""
    return sa.ForeignKeyConstraint(
        [column],
        [f"{referred}.id"],
        name=op.f(fk_name(table, column, referred)),
        ondelete=ondelete,
    )


def add_foreign_key(
    batch_op: BatchOperations, table: str, column: str, referred: str, ondelete: str
) -> None:
    """`table`.`column` referring to `referred`.id, added to an existing table."""
    batch_op.create_foreign_key(
        op.f(fk_name(table, column, referred)), referred, [column], ["id"], ondelete=ondelete
    )
