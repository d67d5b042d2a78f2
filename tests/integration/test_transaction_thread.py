"""gateway/db/transaction_thread.py on SQLite and PostgreSQL: a transaction is one call on the
thread, committed when its work returns and rolled back when it raises; transactions run in the
order they were handed in; the async engine sees what they committed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.exc import IntegrityError

from gateway.db.session import create_engine, create_sessionmaker
from gateway.db.transaction_thread import TransactionThread, sync_url

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("sqlite+aiosqlite:////var/gw/gateway.db", "sqlite+pysqlite:////var/gw/gateway.db"),
        ("sqlite+aiosqlite://", "sqlite+pysqlite://"),
        ("postgresql+psycopg://u:p@db:5433/gw", "postgresql+psycopg://u:p@db:5433/gw"),
        ("postgresql+asyncpg://u@db/gw", "postgresql+psycopg://u@db/gw"),
        ("postgresql://u@db/gw", "postgresql+psycopg://u@db/gw"),
    ],
)
def test_the_sync_url_names_the_same_database(given: str, expected: str) -> None:
    assert sync_url(given).render_as_string(hide_password=False) == expected


def test_a_backend_without_a_sync_driver_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'mysql'"):
        sync_url("mysql+aiomysql://u@db/gw")


def _insert(n: int, ran: list[int] | None = None) -> Callable[[Connection], int]:
    def work(connection: Connection) -> int:
        connection.execute(text("INSERT INTO numbers (n) VALUES (:n)"), {"n": n})
        if ran is not None:
            ran.append(n)
        return n * 10

    return work


def _insert_then_fail(connection: Connection) -> None:
    connection.execute(text("INSERT INTO numbers (n) VALUES (99)"))
    connection.execute(text("INSERT INTO numbers (n) VALUES (1)"))  # 1 is taken: refused


@pytest.mark.parametrize("database", DATABASES)
def test_transactions_commit_roll_back_and_keep_their_order(
    database: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(database)

    async def scenario() -> None:
        engine = create_engine(url)
        thread = TransactionThread.beside(create_sessionmaker(engine))
        try:
            await thread.run(
                lambda c: c.execute(text("CREATE TABLE numbers (n INTEGER PRIMARY KEY)"))
            )
            ran: list[int] = []
            returned = await asyncio.gather(*(thread.run(_insert(n, ran)) for n in range(1, 21)))
            assert returned == [n * 10 for n in range(1, 21)]
            assert ran == list(range(1, 21))  # one after another, in the order handed in
            with pytest.raises(IntegrityError):
                await thread.run(_insert_then_fail)
            async with engine.connect() as connection:
                rows = (await connection.execute(text("SELECT n FROM numbers"))).scalars()
                assert sorted(rows) == list(range(1, 21))  # 99 was rolled back with its failure
        finally:
            # The PostgreSQL database is the session's (shared by the tests of this worker).
            await thread.run(lambda c: c.execute(text("DROP TABLE IF EXISTS numbers")))
            await thread.close()
            await engine.dispose()
        with pytest.raises(RuntimeError):
            await thread.run(_insert(100))  # closed: nothing more runs

    asyncio.run(scenario())


def test_sessions_without_one_async_engine_are_refused() -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    with pytest.raises(TypeError, match="one AsyncEngine"):
        TransactionThread.beside(async_sessionmaker())
