"""A new batch's items written in bulk, inside the transaction that creates the batch.

On PostgreSQL the rows go through one `COPY ... FROM STDIN` (psycopg's C formatter), the loop
getting a turn between chunks of a few milliseconds: a 90,000-item chat batch took 8.3 s of
SQLAlchemy multi-row INSERTs built on the event loop, and takes ~2.9 s so
(bench/results/batch_scale). SQLite, which has no COPY, takes multi-row INSERTs a chunk at a
time, as before.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.batches.records import NewItem
from gateway.db.models import BatchItem, BatchItemStatus, utcnow

# Rows per INSERT statement (SQLite), and per turn of the event loop (COPY: ~3 ms of CPU).
CHUNK = 250
_COLUMNS = (
    "batch_id",
    "item_index",
    "plan_rank",
    "custom_id",
    "body",
    "status",
    "prompt_tokens",
    "max_tokens",
    "attempts",
    "error",
    "status_code",
    "finished_at",
)
_COPY = f"COPY {BatchItem.__tablename__} ({', '.join(_COLUMNS)}) FROM STDIN"


def _rows(batch_id: str, items: Sequence[NewItem], start: int, now: datetime) -> Iterator[Any]:
    """The items from `start` (at most CHUNK) as rows of _COLUMNS, queued unless refused."""
    for index, item in enumerate(items[start : start + CHUNK], start):
        refused = item.error is not None
        yield (
            batch_id,
            index,
            index,  # plan_rank: submission order until the batch plan is made
            item.custom_id,
            item.body,
            BatchItemStatus.FAILED if refused else BatchItemStatus.QUEUED,
            item.prompt_tokens,
            item.max_tokens,
            0,
            item.error,
            item.status_code,
            now if refused else None,
        )


async def write_items(session: AsyncSession, batch_id: str, items: Sequence[NewItem]) -> None:
    """Inserts the batch's items, in order, in the session's transaction."""
    now = utcnow()
    if session.get_bind().dialect.name != "postgresql":
        for start in range(0, len(items), CHUNK):
            rows = [
                dict(zip(_COLUMNS, row, strict=True)) for row in _rows(batch_id, items, start, now)
            ]
            for row in rows:  # the JSON column takes the body decoded
                row["body"] = msgspec.json.decode(row["body"])
            await session.execute(insert(BatchItem), rows)
        return
    connection = await session.connection()
    raw = (await connection.get_raw_connection()).driver_connection
    assert raw is not None
    async with raw.cursor() as cursor, cursor.copy(_COPY) as copy:
        for start in range(0, len(items), CHUNK):
            for row in _rows(batch_id, items, start, now):
                # The body is JSON text already; the error as SQLAlchemy's JSON column would
                # store it; the enum as its value; strings through the connection's NUL-free
                # dumper (gateway/db/session.py).
                error = row[9]
                await copy.write_row(
                    (
                        *row[:5],
                        row[5].value,
                        *row[6:9],
                        None if error is None else json.dumps(error),
                        *row[10:],
                    )
                )
            await asyncio.sleep(0)  # a turn for the loop's other work between chunks
