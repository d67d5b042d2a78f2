"""Idempotency-Key records against real databases: claim, replay, refusal of another request,
in-use, release on failure, expiry and abandoned claims (gateway/idempotency.py and its SQL)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import msgspec
import pytest
from sqlalchemy import update

from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.db.migrate import downgrade, upgrade
from gateway.db.models import IdempotencyRecord, utcnow
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import GatewayError
from gateway.idempotency import Claim, Idempotency, Replay
from gateway.stores.idempotency_records import IdempotencyStore

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]
BODY = b'{"model": "m", "prompt": "p", "max_tokens": 3}'
SAME_BODY_OTHER_ORDER = b'{"max_tokens":3,"prompt":"p","model":"m"}'


class Answer(msgspec.Struct):
    text: str


async def _exercise(url: str) -> None:
    engine = create_engine(url)
    sessions = create_sessionmaker(engine)
    idempotency = Idempotency(IdempotencyStore(sessions), ttl_s=3600, request_timeout_s=60)
    runs = 0

    async def run() -> Answer:
        nonlocal runs
        runs += 1
        return Answer(f"run {runs}")

    async def fail() -> Answer:
        raise OpenAIError(503, "no site")

    try:
        assert await idempotency.claim(None, None, "/v1/completions", BODY, False) is None
        claim = await idempotency.claim("k1", None, "/v1/completions", BODY, False)
        assert claim == Claim("anonymous", "k1")
        # Still running: a retry is told to come back.
        with pytest.raises((OpenAIError, GatewayError)) as busy:
            await idempotency.claim("k1", None, "/v1/completions", BODY, False)
        assert (to_openai(busy.value).status, to_openai(busy.value).retry_after_s) == (409, 1)
        assert await idempotency.once(claim, Answer, run) == (Answer("run 1"), False)

        replay = await idempotency.claim(
            "k1", None, "/v1/completions", SAME_BODY_OTHER_ORDER, False
        )
        assert isinstance(replay, Replay)
        assert await idempotency.once(replay, Answer, run) == (Answer("run 1"), True)
        assert runs == 1
        for endpoint, body in (("/v1/completions", b'{"prompt": "q"}'), ("/v1/batches", BODY)):
            with pytest.raises((OpenAIError, GatewayError)) as reused:
                await idempotency.claim("k1", None, endpoint, body, False)
            assert to_openai(reused.value).status == 422
        # Another API key's "k1" is another key.
        assert isinstance(await idempotency.claim("k1", 7, "/v1/completions", BODY, False), Claim)
        for bad in ("", "x" * 256, "caf\u00e9", "tab\there"):
            with pytest.raises((OpenAIError, GatewayError)) as refused:
                await idempotency.claim(bad, None, "/v1/completions", BODY, False)
            assert to_openai(refused.value).status == 400
        with pytest.raises((OpenAIError, GatewayError)) as streamed:
            await idempotency.claim("k2", None, "/v1/completions", BODY, True)
        assert to_openai(streamed.value).body.param == "stream"

        # A failure frees the key: the retry runs.
        failing = await idempotency.claim("k3", None, "/v1/completions", BODY, False)
        with pytest.raises((OpenAIError, GatewayError)):
            await idempotency.once(failing, Answer, fail)
        await idempotency.drain()
        assert isinstance(
            await idempotency.claim("k3", None, "/v1/completions", BODY, False), Claim
        )

        # Expired, or running far past the request timeout (its gateway died): claimed anew.
        async with sessions.begin() as session:
            await session.execute(
                update(IdempotencyRecord)
                .where(IdempotencyRecord.key == "k1")
                .values(expires_at=utcnow() - timedelta(seconds=1))
            )
            await session.execute(
                update(IdempotencyRecord)
                .where(IdempotencyRecord.key == "k3")
                .values(created_at=utcnow() - timedelta(seconds=120))
            )
        assert isinstance(
            await idempotency.claim("k1", None, "/v1/completions", BODY, False), Claim
        )
        assert isinstance(
            await idempotency.claim("k3", None, "/v1/completions", BODY, False), Claim
        )
    finally:
        await engine.dispose()


@pytest.mark.parametrize("database", DATABASES)
def test_idempotency_records(database: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(database)
    upgrade(url)
    try:
        asyncio.run(_exercise(url))
    finally:
        downgrade(url)
