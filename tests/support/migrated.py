"""Running an async exercise against a real database migrated for it, left empty afterwards
(the session's PostgreSQL database is shared by the tests), and plain SQL on one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from sqlalchemy import create_engine, text

from gateway.db.migrate import downgrade, sync_url, upgrade


def run_migrated(url: str, exercise: Callable[[str], Coroutine[Any, Any, None]]) -> None:
    upgrade(url)
    try:
        asyncio.run(exercise(url))
    finally:
        downgrade(url)


def execute_sql(url: str, *statements: str) -> None:
    """Runs `statements` in one transaction on the database at `url` (a test's triggers)."""
    engine = create_engine(sync_url(url))
    try:
        with engine.begin() as connection:
            for statement in statements:
                connection.execute(text(statement))
    finally:
        engine.dispose()
