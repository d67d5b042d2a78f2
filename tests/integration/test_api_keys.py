"""Client API keys against real databases: only a hash is stored, lookup and revocation as the
client APIs see them, and usage summed from the request log's rows."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.db.models import ApiKey, InferenceRequest, RequestStatus, utcnow
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import GatewayError
from gateway.federation import SiteConfig
from gateway.stores.request_log import NewRequest, Outcome, RequestLog
from gateway.stores.site_store import sync_sites
from gateway.tenancy.admission import Tenancy
from gateway.tenancy.key_limits import LocalKeyLimits
from gateway.tenancy.keys import KeyService
from tests.support.migrated import run_migrated

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]
SITE = SiteConfig("a", "aws", "us-east-1", "127.0.0.1:1", "m")


def _request(request_id: str, site_id: int | None, key_id: int | None, prompt: int) -> NewRequest:
    return NewRequest(
        request_id, "completions", "m", False, None, prompt, 16, "round_robin", site_id,
        api_key_id=key_id,
    )  # fmt: skip


async def _keys_and_revocation(
    sessions: async_sessionmaker[AsyncSession], keys: KeyService, tenancy: Tenancy
) -> int:
    new = await keys.create("team-a", requests_per_minute=60, tokens_per_minute=10_000)
    plaintext = new.plaintext
    assert plaintext.startswith("fk-")
    assert new.record.prefix == plaintext[:11]
    async with sessions() as session:
        row = (await session.scalars(select(ApiKey))).one()
        stored = [str(getattr(row, column.key)) for column in ApiKey.__table__.columns]
    assert row.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert not any(plaintext in value for value in stored), "the plaintext key was stored"

    assert await keys.find(plaintext) == new.record
    assert await keys.find(plaintext + "x") is None
    caller = await tenancy.authenticate(f"Bearer {plaintext}")
    assert caller.key == new.record
    with pytest.raises((OpenAIError, GatewayError), match="Incorrect API key provided"):
        await tenancy.authenticate(f"Bearer {plaintext[:-1]}")

    other = await keys.create("team-b", None, None)
    assert [k.name for k in await keys.list_keys()] == ["team-a", "team-b"]
    revoked = await tenancy.revoke(new.record.id)
    assert revoked is not None
    assert revoked.revoked_at is not None
    again = await keys.revoke(new.record.id)
    assert again is not None
    assert again.revoked_at == revoked.revoked_at  # the first revocation stands
    assert await keys.revoke(10_000) is None
    with pytest.raises((OpenAIError, GatewayError), match="has been revoked") as refused:
        await tenancy.authenticate(f"Bearer {plaintext}")
    assert (to_openai(refused.value).status, to_openai(refused.value).body.code) == (
        401,
        "invalid_api_key",
    )
    assert (await tenancy.authenticate(f"Bearer {other.plaintext}")).key == other.record
    return new.record.id


async def _usage(sessions: async_sessionmaker[AsyncSession], keys: KeyService, key_id: int) -> None:
    other = (await keys.create("other", None, None)).record.id
    site_id = (await sync_sites(sessions, (SITE,)))["a"]
    log = RequestLog(sessions)
    await log.accepted(_request("done", site_id, key_id, 10))
    await log.finished("done", Outcome(RequestStatus.COMPLETED, site_id, 1, 7, "length"))
    await log.accepted(_request("cut", site_id, key_id, 20))
    await log.finished("cut", Outcome(RequestStatus.CANCELLED, site_id, 1, 3))
    await log.accepted(_request("nosite", None, key_id, 40))  # refused: no site could take it
    await log.finished("nosite", Outcome(RequestStatus.FAILED, None, 0, error="no site"))
    await log.accepted(_request("old", site_id, key_id, 1000))
    await log.accepted(_request("theirs", site_id, other, 500))
    await log.accepted(_request("anonymous", site_id, None, 300))
    async with sessions.begin() as session:
        await session.execute(
            update(InferenceRequest)
            .where(InferenceRequest.id == "old")
            .values(created_at=utcnow() - timedelta(hours=2))
        )
    usage = await keys.usage(key_id, utcnow() - timedelta(hours=1))
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (3, 30, 10)
    usage = await keys.usage(key_id, utcnow() - timedelta(hours=3))
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (4, 1030, 10)
    empty = await keys.usage(10_000, utcnow() - timedelta(hours=1))
    assert (empty.requests, empty.prompt_tokens, empty.completion_tokens) == (0, 0, 0)


async def _exercise(url: str) -> None:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    try:
        keys = KeyService(sessions)
        tenancy = Tenancy(keys, LocalKeyLimits(), require_keys=True)
        key_id = await _keys_and_revocation(sessions, keys, tenancy)
        await _usage(sessions, keys, key_id)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_api_keys(database: str, request: pytest.FixtureRequest) -> None:
    run_migrated(request.getfixturevalue(database), _exercise)
