"""Engine and session factory for the gateway's database."""

from __future__ import annotations

from typing import Any

from psycopg.abc import Buffer
from psycopg.types.string import StrBinaryDumper, StrDumperUnknown
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.ext.asyncio import AsyncSession as AsyncSession
from sqlalchemy.orm import configure_mappers

# One writer at a time on SQLite: wait for the lock instead of failing under load.
SQLITE_CONNECT_ARGS = {"timeout": 30}


class SessionStore:
    """A store over the gateway's database: each of its methods opens a session of its own."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions


def create_engine(database_url: str) -> AsyncEngine:
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        engine = create_async_engine(url, connect_args=SQLITE_CONNECT_ARGS)
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        return engine
    engine = create_async_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    event.listen(engine.sync_engine, "connect", postgres_text)
    return engine


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


# PostgreSQL's text cannot hold U+0000 (its driver refuses the whole statement), yet clients send
# it in prompts, `user`, ids and file names: a request row refused for it was a request served and
# never billed (issue 32). Every string a gateway binds on PostgreSQL is sent with U+0000 as
# U+FFFD (the replacement character), whatever column or query it is for; JSON columns are
# unaffected (their text escapes it as \u0000). SQLite stores it as it is.
NUL, NUL_STORED_AS = "\x00", "\ufffd"


class _NulFreeText(StrDumperUnknown):
    def dump(self, obj: str) -> Buffer | None:
        return super().dump(obj.replace(NUL, NUL_STORED_AS) if NUL in obj else obj)


class _NulFreeTextBinary(StrBinaryDumper):
    def dump(self, obj: str) -> Buffer | None:
        return super().dump(obj.replace(NUL, NUL_STORED_AS) if NUL in obj else obj)


def postgres_text(dbapi_connection: Any, _record: Any) -> None:
    """On each new PostgreSQL connection (a `connect` listener): strings bound NUL-free. The
    binary dumper first, then the text one, which thereby stays psycopg's choice for `%s`
    (untyped: the server infers each parameter's type, as before)."""
    adapters = getattr(dbapi_connection, "driver_connection", dbapi_connection).adapters
    adapters.register_dumper(str, _NulFreeTextBinary)
    adapters.register_dumper(str, _NulFreeText)


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    # The ORM's mappers are configured once, on the first model object or query: done lazily
    # it ran on the event loop within the first request that wrote a row (a batch's create held
    # the loop 35-72 ms of CPU at a stretch, issue 67); here it runs as the gateway assembles.
    configure_mappers()
    return async_sessionmaker(engine, expire_on_commit=False)


def create_counter_engine(database_url: str) -> AsyncEngine:
    """A small PostgreSQL pool for the per-key limit counters (gateway/stores/key_limit_store.py),
    whose statements are on the request path. Each costs one round trip: autocommit (each
    statement is atomic on its own: no BEGIN and COMMIT trips), no ping before it (a connection
    found dead is retried once by the store), and no wait for the WAL flush at commit
    (synchronous_commit=off): the counters are soft state, and a database crash may lose well
    under a second of them, which only lets that much more through in that minute. The request
    log and everything else keep their durable commits on the main engine."""
    engine = create_async_engine(
        database_url,
        pool_size=5,
        max_overflow=10,
        isolation_level="AUTOCOMMIT",
        connect_args={"options": "-c synchronous_commit=off"},
    )
    event.listen(engine.sync_engine, "connect", postgres_text)
    return engine
