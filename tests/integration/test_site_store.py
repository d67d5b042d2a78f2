"""The sites table synced by several gateway processes at once (GATEWAY_WORKERS start together
on one database), against real SQLite and PostgreSQL: a CI run found one worker failing its start
on the sites' unique name, and restarted by its supervisor."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from gateway.db.migrate import upgrade
from gateway.db.models import Site
from gateway.db.session import create_engine, create_sessionmaker
from gateway.federation import SiteConfig
from gateway.stores.site_store import enable_site, sync_sites

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]
SITES = (SiteConfig("aws-use1", "aws", "us-east-1", "127.0.0.1:9", "m"),
         SiteConfig("gcp-euw4", "gcp", "europe-west4", "127.0.0.1:10", "m"))  # fmt: skip


@pytest.mark.parametrize("database", DATABASES)
def test_workers_syncing_an_empty_database_at_once_all_start_with_one_row_a_site(
    database: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(database)
    upgrade(url)

    async def exercise() -> None:
        # One engine a worker: each its own connection, as separate processes have.
        engines = [create_engine(url) for _ in range(4)]
        try:
            ids = await asyncio.gather(
                *(sync_sites(create_sessionmaker(engine), SITES) for engine in engines)
            )
            joined = await asyncio.gather(
                *(enable_site(create_sessionmaker(e), SITES[0]) for e in engines)
            )
            async with create_sessionmaker(engines[0])() as session:
                rows = (await session.scalars(select(Site).order_by(Site.name))).all()
        finally:
            for engine in engines:
                await engine.dispose()
        assert all(found == ids[0] for found in ids)
        assert set(joined) == {ids[0]["aws-use1"]}
        assert [(r.name, r.region, r.enabled) for r in rows] == [
            ("aws-use1", "us-east-1", True), ("gcp-euw4", "europe-west4", True)
        ]  # fmt: skip

    asyncio.run(exercise())
