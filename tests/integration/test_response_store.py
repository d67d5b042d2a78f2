"""Stored responses against real databases: written whole and read back with their items,
scoped to the key that made them (another key, or a caller without one, reads nothing and
deletes nothing), unreadable once expired and then deleted by the purge."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import pytest

from gateway.db.migrate import downgrade, upgrade
from gateway.db.models import utcnow
from gateway.db.session import create_engine, create_sessionmaker
from gateway.responses.items import input_items, items_from_json
from gateway.stores.response_store import NewResponse, ResponseStore
from gateway.tenancy.keys import KeyService

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]


@dataclass
class Db:
    store: ResponseStore
    alice: int
    bob: int


@pytest.fixture(params=DATABASES)
def run(request) -> Iterator[Callable[[Callable[[Db], Awaitable[None]]], None]]:
    url = request.getfixturevalue(request.param)
    upgrade(url)

    async def go(scenario: Callable[[Db], Awaitable[None]]) -> None:
        engine = create_engine(url)
        try:
            sessions = create_sessionmaker(engine)
            keys = KeyService(sessions)
            alice = (await keys.create("alice", None, None)).record.id
            bob = (await keys.create("bob", None, None)).record.id
            await scenario(Db(ResponseStore(sessions), alice, bob))
        finally:
            await engine.dispose()

    try:
        yield lambda scenario: asyncio.run(go(scenario))
    finally:
        downgrade(url)


def new_response(owner: int | None, expires_in_s: float = 3600) -> NewResponse:
    response_id = f"resp_{uuid.uuid4().hex}"
    items = input_items([{"role": "user", "content": "Hi"},
                         {"type": "function_call", "call_id": "c1", "name": "f",
                          "arguments": "{}"}])  # fmt: skip
    return NewResponse(
        id=response_id,
        owner=owner,
        model="m",
        expires_at=utcnow() + timedelta(seconds=expires_in_s),
        response={"id": response_id, "object": "response", "output": []},
        input_items=msgspec.to_builtins(items),
        history=msgspec.to_builtins(input_items("Earlier")),
    )


def test_responses_are_read_back_by_their_owner_only(run) -> None:
    async def scenario(db: Db) -> None:
        mine, keyless = new_response(db.alice), new_response(None)
        await db.store.add(mine)
        await db.store.add(keyless)
        record = await db.store.get(mine.id, db.alice)
        assert record is not None
        assert record.response == mine.response
        assert items_from_json(record.input_items) == items_from_json(mine.input_items)
        assert items_from_json(record.history)[0].id == mine.history[0]["id"]
        assert await db.store.get(mine.id, db.bob) is None
        assert await db.store.get(mine.id, None) is None
        assert await db.store.get(keyless.id, db.alice) is None
        assert await db.store.get(keyless.id, None) is not None
        assert not await db.store.delete(mine.id, db.bob)
        assert not await db.store.delete(mine.id, None)
        assert await db.store.delete(mine.id, db.alice)
        assert await db.store.get(mine.id, db.alice) is None
        assert not await db.store.delete(mine.id, db.alice)

    run(scenario)


def test_expired_responses_are_neither_read_nor_kept(run) -> None:
    async def scenario(db: Db) -> None:
        old, live = new_response(db.alice, expires_in_s=-1), new_response(db.alice)
        await db.store.add(old)
        await db.store.add(live)
        assert await db.store.get(old.id, db.alice) is None
        assert not await db.store.delete(old.id, db.alice)
        assert await db.store.delete_expired() == 1
        assert await db.store.get(live.id, db.alice) is not None

    run(scenario)
