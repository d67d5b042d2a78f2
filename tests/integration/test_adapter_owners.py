"""Adapter owners against real databases (issue 58): what one gateway's catalogue declares,
another's reads on its next refresh, by key id; a deleted key's private adapters fall back to
no one's; migration 0023 gives the fine-tuned models of jobs that succeeded before it their
owners."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy import text

from gateway.db.migrate import downgrade, sync_url, upgrade
from gateway.db.session import create_engine, create_sessionmaker
from gateway.model_catalogue import AdapterCatalogue
from gateway.sites.registry import SiteRegistry
from gateway.stores.adapter_owners import AdapterOwnerStore, Ownership
from gateway.tenancy.keys import KeyService
from tests.unit.test_adapter_models import _site

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]


@pytest.mark.parametrize("database", DATABASES)
def test_owners_are_shared_by_every_catalogue_of_the_database(database, request) -> None:
    url = request.getfixturevalue(database)
    upgrade(url)
    registry = SiteRegistry([_site("a", "m", ("a-ft", "pub-ft"))])

    async def scenario() -> None:
        engine = create_engine(url)
        try:
            sessions = create_sessionmaker(engine)
            keys = KeyService(sessions)
            alice = (await keys.create("acme", None, None)).record.id
            twin = (await keys.create("acme", None, None)).record.id  # the same name
            store = AdapterOwnerStore(sessions)
            loader, replica = (AdapterCatalogue(registry, (), store) for _ in range(2))
            await loader.declare(Ownership("a-ft", "m", key_id=alice))
            await loader.declare(Ownership("pub-ft", "m", public=True))
            assert not replica.may_use("a-ft", alice, "acme")  # not read yet: no one's
            await replica.refresh()
            assert replica.may_use("a-ft", alice, "acme")
            assert not replica.may_use("a-ft", twin, "acme")
            assert replica.may_use("pub-ft", twin, "acme")
            await loader.declare(Ownership("a-ft", "m", key_id=twin))  # replaced, not added
            assert await store.get("a-ft") == Ownership("a-ft", "m", key_id=twin)
            await loader.forget("pub-ft")
            await replica.refresh()
            assert not replica.may_use("pub-ft", alice, "acme")
            async with sessions.begin() as session:  # a key deleted: its rows go with it
                await session.execute(text(f"DELETE FROM api_keys WHERE id = {twin}"))
            await replica.refresh()
            assert replica.stored("a-ft") is None
            assert not any(replica.may_use("a-ft", k, "acme") for k in (alice, twin, None))
        finally:
            await engine.dispose()

    try:
        asyncio.run(scenario())
    finally:
        downgrade(url)


@pytest.mark.parametrize("database", DATABASES)
def test_the_migration_gives_earlier_fine_tuned_models_their_owners(database, request) -> None:
    url = request.getfixturevalue(database)
    upgrade(url, "0022")
    engine = create_sync_engine(sync_url(url))
    job = ("INSERT INTO fine_tuning_jobs (id, api_key_id, model, training_file, seed, n_epochs, "
           "batch_size, learning_rate_multiplier, status, step, total_steps, trained_tokens, "
           "reported_step, fine_tuned_model, created_at) VALUES ('{id}', {key}, 'm', 'file-1', 0, "
           "1, 1, 1.0, '{status}', 0, 0, 0, 0, {model}, CURRENT_TIMESTAMP)")  # fmt: skip
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO api_keys (name, prefix, key_hash, created_at) "
                    "VALUES ('acme', 'p', 'h', CURRENT_TIMESTAMP)"
                )
            )
            key = connection.execute(text("SELECT id FROM api_keys")).scalar_one()
            for values in (
                {"id": "ftjob-1", "key": key, "status": "succeeded", "model": "'ft:m::1'"},
                {"id": "ftjob-2", "key": "NULL", "status": "succeeded", "model": "'ft:m::2'"},
                {"id": "ftjob-3", "key": key, "status": "running", "model": "NULL"},
            ):
                connection.execute(text(job.format(**values)))
        upgrade(url)
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT name, parent, public, api_key_id FROM adapter_owners ORDER BY name")
            )
            assert [tuple(row) for row in rows] == [
                ("ft:m::1", "m", False, key),
                ("ft:m::2", "m", False, None),  # made without a key: callers without one
            ]
    finally:
        engine.dispose()
        downgrade(url)


class _SlowWrites(AdapterOwnerStore):
    """The real store, whose writes start only once `release` is set: a write in flight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.writing = asyncio.Event()
        self.release = asyncio.Event()

    async def put(self, owner: Ownership) -> None:
        self.writing.set()
        await self.release.wait()
        await super().put(owner)


def test_a_refresh_during_a_declaration_does_not_undo_it(sqlite_url) -> None:
    # CI (issue 72): a refresh that read the rows while a fine-tuned model's row was still being
    # written wrote memory without it, and the model was missing from /v1/models after its job
    # succeeded (until the next refresh).
    upgrade(sqlite_url)
    registry = SiteRegistry([_site("a", "m", ("a-ft",))])

    async def scenario() -> None:
        engine = create_engine(sqlite_url)
        try:
            store = _SlowWrites(create_sessionmaker(engine))
            catalogue = AdapterCatalogue(registry, (), store)
            declare = asyncio.create_task(catalogue.declare(Ownership("a-ft", "m", public=True)))
            await store.writing.wait()
            refresh = asyncio.create_task(catalogue.refresh())
            await asyncio.wait({refresh}, timeout=0.3)  # it reads now, or waits for the write
            store.release.set()
            await asyncio.gather(declare, refresh)
            assert catalogue.may_use("a-ft", None, None)
            await catalogue.forget("a-ft")
            await catalogue.refresh()
            assert not catalogue.may_use("a-ft", None, None)
        finally:
            await engine.dispose()

    try:
        asyncio.run(scenario())
    finally:
        downgrade(sqlite_url)
