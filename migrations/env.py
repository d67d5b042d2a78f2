"""Alembic environment: migrations run on a synchronous connection of the gateway's database."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from gateway.db.migrate import sync_url
from gateway.db.models import Base

config = context.config
target_metadata = Base.metadata


def _database_url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("GATEWAY_DATABASE_URL")
    if not url:
        raise RuntimeError("set GATEWAY_DATABASE_URL (or sqlalchemy.url) to migrate a database")
    return sync_url(url)


def run_migrations_offline() -> None:
    context.configure(
        url=_database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_database_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        _run(connection)


def _run(connection: Connection) -> None:
    # Batch mode lets later migrations alter columns on SQLite (which cannot ALTER most things).
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
