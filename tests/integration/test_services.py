"""Services against real databases: site sync, request records, per-site totals."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from gateway.db.migrate import downgrade, upgrade
from gateway.db.models import InferenceRequest, RequestStatus, Site
from gateway.db.session import create_engine, create_sessionmaker
from gateway.federation import SiteConfig
from gateway.stores.request_log import NewRequest, Outcome, RequestLog
from gateway.stores.site_store import sync_sites
from gateway.stores.stats import site_totals

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]
A = SiteConfig("a", "aws", "us-east-1", "127.0.0.1:1", "m")
B = SiteConfig("b", "gcp", "europe-west4", "127.0.0.1:2", "m", capacity_weight=2.0)


def new_request(request_id: str, site_id: int, prompt_tokens: int) -> NewRequest:
    return NewRequest(
        request_id, "completions", "m", False, None, prompt_tokens, 16, "round_robin", site_id
    )


async def exercise(url: str) -> None:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    try:
        ids = await sync_sites(sessions, (A, B))
        log = RequestLog(sessions)
        await log.accepted(new_request("r1", ids["a"], 10))
        await log.accepted(new_request("r2", ids["a"], 20))
        await log.accepted(new_request("r3", ids["b"], 5))
        await log.finished("r1", Outcome(RequestStatus.COMPLETED, ids["a"], 1, 7, "length"))
        await log.finished("r3", Outcome(RequestStatus.FAILED, ids["b"], 2, error="boom"))
        totals = {t.site: t for t in await site_totals(sessions)}
        assert (totals["a"].requests, totals["a"].completed, totals["a"].prompt_tokens) == (
            2,
            1,
            30,
        )
        assert totals["a"].completion_tokens == 7
        assert (totals["b"].requests, totals["b"].failed) == (1, 1)

        # A site removed from the federation file is disabled, not deleted: r3 keeps its site.
        assert await sync_sites(sessions, (A,)) == {"a": ids["a"]}
        async with sessions() as session:
            b = await session.scalar(select(Site).where(Site.name == "b"))
            r3 = await session.get(InferenceRequest, "r3")
        assert b is not None
        assert not b.enabled
        assert r3 is not None
        assert r3.site_id == ids["b"]
        assert r3.attempts == 2
        assert r3.finished_at is not None
        assert r3.finished_at.tzinfo is not None
        assert [t.site for t in await site_totals(sessions)] == ["a"]
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_services_round_trip(database, request) -> None:
    url = request.getfixturevalue(database)
    upgrade(url)
    try:
        asyncio.run(exercise(url))
    finally:
        downgrade(url)
