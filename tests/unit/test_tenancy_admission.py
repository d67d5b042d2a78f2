"""Tenancy glue without a database: reading the credential, 401s that need no lookup, the 429
error's shape, a request's charge and settlement, and the setting that turns keys on."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.errors import GatewayError
from gateway.settings import GatewaySettings, SettingsError
from gateway.tenancy.admission import Caller, KeyAdmission, Tenancy, bearer_credential
from gateway.tenancy.key_limits import LocalKeyLimits
from gateway.tenancy.keys import KeyRecord, KeyService, generate_key, hash_key
from gateway.tenancy.limiter import SlidingWindowLimiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class UnreachableKeys(KeyService):
    """A key store that must not be asked: these cases are decided from the header alone."""

    def __init__(self) -> None:
        pass

    async def find(self, plaintext: str) -> KeyRecord | None:
        raise AssertionError("the key store was consulted")


def _key(rpm: int | None = None, tpm: int | None = None) -> KeyRecord:
    now = datetime.now(UTC)
    return KeyRecord(7, "team-a", "fk-abcdefgh", rpm, tpm, now, None)


@pytest.mark.parametrize(
    ("header", "credential"),
    [
        (None, None),
        ("", None),
        ("Bearer fk-abc", "fk-abc"),
        ("bearer   fk-abc  ", "fk-abc"),
        ("Basic Zm9vOmJhcg==", None),
        ("Bearer ", None),
    ],
)
def test_bearer_credential(header: str | None, credential: str | None) -> None:
    assert bearer_credential(header) == credential


@pytest.mark.parametrize(
    ("require", "header", "outcome"),
    [
        (False, None, "anonymous"),
        (False, "Bearer unused", "anonymous"),  # what clients send when there are no keys
        (True, None, "You didn't provide an API key"),
        (True, "Bearer unused", "not a key of this gateway"),
        (True, "Basic Zm9vOmJhcg==", "You didn't provide an API key"),
    ],
)
def test_authentication_decided_by_the_header_alone(
    require: bool, header: str | None, outcome: str
) -> None:
    tenancy = Tenancy(UnreachableKeys(), LocalKeyLimits(), require_keys=require)
    if outcome == "anonymous":
        caller = asyncio.run(tenancy.authenticate(header))
        assert caller.key is None
        assert caller.admission() is None
        asyncio.run(caller.admit_batch([(10, 10)] * 1000))  # anonymous callers have no limits
        return
    with pytest.raises((OpenAIError, GatewayError)) as refused:
        asyncio.run(tenancy.authenticate(header))
    assert to_openai(refused.value).status == 401
    assert to_openai(refused.value).body.code == "invalid_api_key"
    assert outcome in to_openai(refused.value).body.message


def test_request_charge_refused_with_429_and_retry_after() -> None:
    clock = FakeClock()
    admission = KeyAdmission(LocalKeyLimits(SlidingWindowLimiter(clock)), _key(rpm=1))
    asyncio.run(admission.charge(30, 30))
    clock.now = 15.2
    with pytest.raises((OpenAIError, GatewayError)) as refused:
        asyncio.run(KeyAdmission(admission.limits, admission.key).charge(30, 30))
    error = to_openai(refused.value)
    assert (error.status, error.body.code) == (429, "rate_limit_exceeded")
    assert error.body.type == "requests"
    assert error.retry_after_s == 45  # 60 - 15.2, rounded up
    assert "fk-abcdefgh" in error.body.message
    assert "limit 1" in error.body.message


def test_settlement_replaces_the_pre_charge() -> None:
    limiter = SlidingWindowLimiter(FakeClock())
    admission = KeyAdmission(LocalKeyLimits(limiter), _key(tpm=100))
    asyncio.run(admission.charge(90, 90))  # prompt + predicted answer
    admission.settle(25)  # prompt + what was really generated
    assert limiter.used(7) == (1, 25)
    # The freed budget is usable at once.
    asyncio.run(KeyAdmission(admission.limits, admission.key).charge(75, 75))


def test_batch_larger_than_the_limit_is_refused_without_retry_after() -> None:
    limits = LocalKeyLimits()
    caller = Caller(Tenancy(UnreachableKeys(), limits, False), _key(tpm=1000))
    with pytest.raises((OpenAIError, GatewayError)) as refused:
        asyncio.run(caller.admit_batch([(100, 16)] * 10))  # 1160 tokens at once
    assert to_openai(refused.value).status == 429
    assert to_openai(refused.value).retry_after_s is None
    assert "this batch of 10 requests is too large" in to_openai(refused.value).body.message
    asyncio.run(caller.admit_batch([(100, 16)] * 8))
    assert limits.limiter.used(7) == (8, 928)


def test_keys_are_high_entropy_and_hashed() -> None:
    keys = {generate_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(key.startswith("fk-") and len(key) == 3 + 43 for key in keys)
    key = next(iter(keys))
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()


def test_requiring_keys_needs_the_admin_credential() -> None:
    env = {"GATEWAY_FEDERATION_FILE": "f.json", "GATEWAY_REQUIRE_API_KEYS": "true"}
    with pytest.raises(SettingsError, match="GATEWAY_REQUIRE_API_KEYS needs GATEWAY_ADMIN_TOKEN"):
        GatewaySettings.from_env(env)
    settings = GatewaySettings.from_env({**env, "GATEWAY_ADMIN_TOKEN": "x" * 16})
    assert settings.access.require_api_keys
    assert not GatewaySettings(federation_file=Path("f.json")).access.require_api_keys


def test_work_charged_already_waits_for_a_slot_of_its_capped_key() -> None:
    """A batch item holds one of its key's concurrency slots while it runs; over the cap it
    waits for one (it was charged at submission) instead of failing."""

    async def run() -> None:
        key = KeyRecord(7, "team-a", "fk-abcdefgh", None, None, datetime.now(UTC), None, 1)
        tenancy = Tenancy(UnreachableKeys(), LocalKeyLimits(), require_keys=True)
        order: list[str] = []
        first_in, first_out = asyncio.Event(), asyncio.Event()

        async def item(name: str, hold_until: asyncio.Event | None) -> None:
            async with tenancy.key_slot(key):
                order.append(f"{name} runs")
                first_in.set()
                if hold_until is not None:
                    await hold_until.wait()
                order.append(f"{name} ends")

        first = asyncio.create_task(item("first", first_out))
        await first_in.wait()
        second = asyncio.create_task(item("second", None))
        for _ in range(20):  # the second keeps looking while the first runs
            await asyncio.sleep(0)
        assert order == ["first runs"]
        first_out.set()
        await asyncio.gather(first, second)
        assert order == ["first runs", "first ends", "second runs", "second ends"]
        async with tenancy.key_slot(None):  # no key: nothing to hold
            pass

    asyncio.run(run())
