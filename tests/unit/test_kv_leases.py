"""The site's lease bookkeeping of KV lendings (site_engine/kv_leases.py) over an engine that
lends as PagedEngine does (one lending at a time, all of it back at once), and who may call the
lending RPCs (site_engine/kv_lending_access.py). Over real gRPC and real sites:
tests/security/test_kv_lending_leases.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from site_engine.kv_leases import (
    AlreadyLending,
    KvLeases,
    LeaseArgumentError,
    LeaseNotHeld,
)
from site_engine.kv_lending_access import LendingAccess, peer_is_loopback
from site_engine.settings import SettingsError, SiteSettings

A, B = "a" * 24, "b" * 24


class Engine:
    """PagedEngine's lend_kv / return_kv as the leases see them; `full` makes a take-back fail
    (the memory cannot be had again) until cleared."""

    def __init__(self) -> None:
        self.lent = 0
        self.full = False
        self.returns = 0

    async def lend_kv(self, wanted_bytes: int) -> int:
        if self.lent:
            raise ValueError("it already lends")
        self.lent = wanted_bytes
        return wanted_bytes

    async def return_kv(self) -> int:
        self.returns += 1
        if self.full:
            raise RuntimeError("CUDA out of memory")
        lent, self.lent = self.lent, 0
        return lent


async def _until(check: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_only_the_lease_returns_or_renews_and_a_term_is_bounded() -> None:
    async def run() -> None:
        engine = Engine()
        leases = KvLeases(engine)
        assert await leases.lend(A, 100, 60.0) == 100
        with pytest.raises(AlreadyLending):
            await leases.lend(B, 100, 60.0)
        assert await leases.give_back(B) == 0
        with pytest.raises(LeaseNotHeld):
            await leases.renew(B, 60.0)
        assert engine.lent == 100
        assert await leases.renew(A, 60.0) == 100
        assert await leases.give_back(A) == 100
        assert (engine.lent, leases.held()) == (0, None)
        assert await leases.give_back(A) == 0  # once
        for bad_id, ttl_s in (("short", 60.0), ("x" * 129, 60.0), ("a b" * 8, 60.0),
                              (A, 0.5), (A, 3601.0), (A, 0.0)):  # fmt: skip
            with pytest.raises(LeaseArgumentError):
                await leases.lend(bad_id, 100, ttl_s)
        assert engine.lent == 0

    asyncio.run(run())


def test_an_expired_lease_is_taken_back_after_a_longer_lease_before_it() -> None:
    """A lease of 1 s lent after one of 60 s was returned expires in about 1 s (the watch of
    the first no longer sleeps its 60 s)."""

    async def run() -> None:
        engine = Engine()
        leases = KvLeases(engine)
        await leases.lend(A, 100, 60.0)
        await leases.give_back(A)
        await leases.lend(B, 100, 1.0)
        started = time.monotonic()
        await _until(lambda: leases.held() is None)
        assert time.monotonic() - started < 10.0
        assert engine.lent == 0
        with pytest.raises(LeaseNotHeld):
            await leases.renew(B, 60.0)

    asyncio.run(run())


def test_a_renewed_lease_is_kept_and_a_take_back_that_fails_is_retried() -> None:
    async def run() -> None:
        engine = Engine()
        leases = KvLeases(engine, retry_s=0.05)
        await leases.lend(A, 100, 1.0)
        for _ in range(6):  # 1.8 s, under renewals every 0.3 s
            await asyncio.sleep(0.3)
            assert await leases.renew(A, 1.0) == 100
        assert engine.returns == 0
        engine.full = True  # the borrower still holds the memory on the GPU
        await _until(lambda: engine.returns >= 3)
        lease = leases.held()
        assert lease is not None
        assert lease.expired
        with pytest.raises(LeaseNotHeld):
            await leases.renew(A, 1.0)  # past its term: no longer renewed
        engine.full = False
        await _until(lambda: leases.held() is None)
        assert engine.lent == 0

    asyncio.run(run())


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("ipv4:127.0.0.1:50000", True),
        ("ipv4:127.8.9.10:1", True),
        ("ipv6:[::1]:50000", True),
        ("ipv6:%5B::1%5D:50000", True),
        ("ipv6:[::ffff:127.0.0.1]:50000", True),
        ("unix:/tmp/site.sock", True),
        ("ipv4:192.0.2.7:50000", False),
        ("ipv6:[2001:db8::1]:50000", False),
        ("ipv6:[::ffff:192.0.2.7]:50000", False),
        ("ipv4:localhost:1", False),
        ("", False),
    ],
)
def test_loopback_peers(peer: str, loopback: bool) -> None:
    assert peer_is_loopback(peer) is loopback


def _tls(*names: bytes) -> dict[str, list[bytes]]:
    return {"transport_security_type": [b"ssl"], "x509_common_name": list(names[:1]),
            "x509_subject_alternative_name": list(names[1:])}  # fmt: skip


def test_only_the_gateway_may_lend() -> None:
    plaintext = {"transport_security_type": [b"insecure"]}
    access = LendingAccess("fedllm-gateway")
    assert access.refusal("ipv4:127.0.0.1:1", plaintext) is None
    assert "loopback" in (access.refusal("ipv4:192.0.2.7:1", plaintext) or "")
    assert access.refusal("ipv4:192.0.2.7:1", _tls(b"fedllm-gateway")) is None
    assert access.refusal("ipv4:192.0.2.7:1", _tls(b"gw", b"fedllm-gateway")) is None  # a SAN
    # A certificate of the same CA that is not the gateway's (a site's), even on loopback.
    assert access.refusal("ipv4:127.0.0.1:1", _tls(b"aws-use1-1")) is not None
    # Over TLS without the gateway's name configured: no one.
    assert LendingAccess().refusal("ipv4:127.0.0.1:1", _tls(b"fedllm-gateway")) is not None


def test_the_gateway_identity_setting() -> None:
    settings = SiteSettings.load({"SITE_GATEWAY_IDENTITY": "fedllm-gateway"}, model_dir="m")
    assert settings.gateway_identity == "fedllm-gateway"
    assert SiteSettings.load({}, model_dir="m").gateway_identity is None
    assert SiteSettings.load({"SITE_GATEWAY_IDENTITY": ""}, model_dir="m").gateway_identity is None
    for bad in ("gate\x00way", "x" * 254):
        with pytest.raises(SettingsError, match="SITE_GATEWAY_IDENTITY"):
            SiteSettings.load({"SITE_GATEWAY_IDENTITY": bad}, model_dir="m")
