"""Whole transactions on a synchronous engine, each run as one call on a worker thread.

The request log writes a batch as one transaction of a few executemany statements. Through the
async engine every DBAPI call is a hand-off of its own: aiosqlite runs each one (cursor,
execute, commit, the pool's reset on return, ...) on its thread and wakes the event loop after
it, about 16 round trips between two threads per transaction, all on the gateway's one core;
psycopg's async driver wakes the loop once per round trip to the server. Here the transaction is
one call on a worker thread (the drivers release the GIL while they wait on the database), so
the loop hands off once per batch: bench/results/gateway_overhead/request_log_thread.md (CPU per
transaction alone, and the gateway at concurrency 1 with each writer side by side).

One thread, one connection: transactions run one after another in the order they were handed
in. A transaction that has begun is not interrupted when its caller is cancelled: it commits or
fails on its own, and the caller only stops waiting for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.db.session import SQLITE_CONNECT_ARGS, postgres_text, sqlite_pragmas

T = TypeVar("T")
# The synchronous driver of each backend the gateway runs on (its async URLs name aiosqlite or
# psycopg; psycopg serves both APIs).
_SYNC_DRIVERS = {"sqlite": "sqlite+pysqlite", "postgresql": "postgresql+psycopg"}


def sync_url(database_url: str | URL) -> URL:
    """The same database through the backend's synchronous driver."""
    url = make_url(database_url)
    backend = url.get_backend_name()
    if backend not in _SYNC_DRIVERS:
        raise ValueError(f"no synchronous driver for {backend!r} databases (sqlite, postgresql)")
    return url.set(drivername=_SYNC_DRIVERS[backend])


def _sync_engine(database_url: str | URL) -> Engine:
    url = sync_url(database_url)
    if url.get_backend_name() == "sqlite":
        engine = create_engine(url, connect_args=SQLITE_CONNECT_ARGS)
        event.listen(engine, "connect", sqlite_pragmas)
        return engine
    # One thread uses it: one connection, checked before use (the server may have restarted).
    engine = create_engine(url, pool_pre_ping=True, pool_size=1, max_overflow=0)
    event.listen(engine, "connect", postgres_text)
    return engine


class TransactionThread:
    def __init__(self, database_url: str | URL) -> None:
        # Neither connects nor starts its thread before the first transaction.
        self._engine = _sync_engine(database_url)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="transactions")

    @classmethod
    def beside(cls, sessions: async_sessionmaker[AsyncSession]) -> TransactionThread:
        """On the database of the async engine that `sessions` are bound to."""
        bind = sessions.kw.get("bind")
        if not isinstance(bind, AsyncEngine):
            raise TypeError("the sessions are not bound to one AsyncEngine")
        return cls(bind.url)

    async def run(self, work: Callable[[Connection], T]) -> T:
        """`work(connection)` inside one transaction on the thread: committed when it returns,
        rolled back when it raises (the exception comes back here)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._transaction, work)

    def _transaction(self, work: Callable[[Connection], T]) -> T:
        with self._engine.begin() as connection:
            return work(connection)

    async def close(self) -> None:
        """Closes the connection once the transactions handed in before are done."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._engine.dispose)
        self._executor.shutdown(wait=False)
