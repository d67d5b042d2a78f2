"""The Alembic migrations build exactly the ORM schema, on SQLite and on PostgreSQL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from gateway.db.migrate import downgrade, sync_url, upgrade
from gateway.db.models import Base

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]


@pytest.mark.parametrize("database", DATABASES)
def test_upgrade_matches_models_and_downgrade_removes_everything(database, request) -> None:
    url = request.getfixturevalue(database)
    upgrade(url)
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as connection:
            diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
            assert diff == [], f"models and migrations disagree: {diff}"
            assert {"sites", "requests"} <= set(inspect(connection).get_table_names())
        downgrade(url)
        with engine.connect() as connection:
            assert set(inspect(connection).get_table_names()) <= {"alembic_version"}
        upgrade(url)  # and back up again: downgrade left nothing behind that blocks it
    finally:
        downgrade(url)
        engine.dispose()
