"""Issue 67: whoever reached a site's gRPC port could call LendKv and ReturnKv. One such caller
shrank a site's KV cache from 2,048 to 512 blocks, with no lease or expiry (four concurrent
requests then took 60.5 s instead of 25.9 s), and any caller could return a real borrower's
memory.

Now, against real site processes over real gRPC (the gateway's own client, GrpcSiteClient, as
the holder): a lending is held under the lease its caller named, and only a call naming that
lease returns or renews it; a lease not renewed in time is taken back by the site; and only the
gateway may call the lending RPCs at all: over plaintext a caller on loopback, over mutual TLS a
client whose certificate names SITE_GATEWAY_IDENTITY (another certificate of the same CA, such
as a site's, is refused)."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devtools.launch import ManagedProcess, start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import KvLease, KvLeaseLost, SiteCallError
from gateway.sites.tls import SiteTls
from tests.support.tls_certs import TestPki, make_pki

pytestmark = pytest.mark.slow
MIB = 1 << 20
KV_CACHE_MIB = 8
RECLAIMED_WITHIN_S = 30.0  # a 1 s lease on a loaded 2-core machine


def _lease(ttl_s: float = 60.0) -> KvLease:
    return KvLease(secrets.token_urlsafe(24), ttl_s)


def _lan_address() -> str | None:
    """This host's address on a non-loopback interface (None: it has none)."""
    for destination in ("10.254.254.254", "192.0.2.1", "198.51.100.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((destination, 9))  # no packet is sent: it only picks a route
            except OSError:
                continue
            address = str(probe.getsockname()[0])
        if not address.startswith("127."):
            return address
    return None


@pytest.fixture(scope="module")
def site(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A plaintext site on every address (as SITE_ALLOW_PLAINTEXT permits), so that it can be
    reached from loopback and from off it; its port."""
    process = start_site(
        model_dir=tiny_llama_dir,
        site_name="lender",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("lender"),
        extra_args=["--host", "0.0.0.0", "--allow-plaintext", "--kv-cache-mib", str(KV_CACHE_MIB)],
    )
    assert process.port is not None
    yield process.port
    process.stop()


async def _blocks(client: GrpcSiteClient) -> int:
    return (await client.info()).kv_blocks_total


def test_only_the_leases_holder_returns_or_renews_a_lending(site: int) -> None:
    async def run() -> None:
        gateway = GrpcSiteClient("lender", f"127.0.0.1:{site}", 30.0)
        try:
            full = await _blocks(gateway)
            assert await gateway.kv_room() >= MIB
            lease = _lease()
            lent = await gateway.lend_kv(MIB, lease)
            assert lent >= MIB
            shrunk = await _blocks(gateway)
            assert shrunk < full
            # Another caller, even on the gateway's own host, that does not hold the lease:
            # its return changes nothing and its renewal is refused.
            assert await gateway.return_kv(secrets.token_urlsafe(24)) == 0
            with pytest.raises(KvLeaseLost):
                await gateway.renew_kv_lease(_lease())
            with pytest.raises(SiteCallError, match="already lends"):
                await gateway.lend_kv(MIB, _lease())
            assert await _blocks(gateway) == shrunk
            # The calls of before leases (no lease named) are refused.
            stub = site_pb2_grpc.SiteEngineStub(gateway._channel)
            for call in (
                stub.ReturnKv(site_pb2.ReturnKvRequest()),
                stub.LendKv(site_pb2.LendKvRequest(bytes=MIB)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert await _blocks(gateway) == shrunk
            # The holder renews it and gives it back, once.
            assert await gateway.renew_kv_lease(lease) == lent
            assert await gateway.return_kv(lease.id) == lent
            assert await _blocks(gateway) == full
            assert await gateway.return_kv(lease.id) == 0
        finally:
            await gateway.close()

    asyncio.run(run())


def test_a_lease_not_renewed_is_taken_back_by_the_site_and_a_renewed_one_is_kept(
    site: int,
) -> None:
    async def run() -> None:
        gateway = GrpcSiteClient("lender", f"127.0.0.1:{site}", 30.0)
        try:
            full = await _blocks(gateway)
            kept = _lease(ttl_s=3.0)
            assert await gateway.lend_kv(MIB, kept) >= MIB
            shrunk = await _blocks(gateway)
            renewed_until = time.monotonic() + 7.0  # over twice its term
            while time.monotonic() < renewed_until:
                await gateway.renew_kv_lease(kept)
                await asyncio.sleep(0.5)
            assert await _blocks(gateway) == shrunk
            assert await gateway.return_kv(kept.id) > 0

            forgotten = _lease(ttl_s=1.0)  # a gateway that lends, then is gone
            assert await gateway.lend_kv(MIB, forgotten) >= MIB
            assert await _blocks(gateway) == shrunk
            deadline = time.monotonic() + RECLAIMED_WITHIN_S
            while await _blocks(gateway) != full:
                assert time.monotonic() < deadline, "the expired lease's memory never came back"
                await asyncio.sleep(0.2)
            with pytest.raises(KvLeaseLost):
                await gateway.renew_kv_lease(forgotten)
            assert await gateway.return_kv(forgotten.id) == 0
            assert await gateway.kv_room() >= MIB  # it may lend again
        finally:
            await gateway.close()

    asyncio.run(run())


def test_a_caller_off_loopback_cannot_lend_or_return_over_plaintext(site: int) -> None:
    address = _lan_address()
    if address is None:
        pytest.skip("this host has no address but loopback")

    async def run() -> None:
        gateway = GrpcSiteClient("lender", f"127.0.0.1:{site}", 30.0)
        lease = _lease()
        try:
            full = await _blocks(gateway)
            async with grpc.aio.insecure_channel(f"{address}:{site}") as channel:
                stub = site_pb2_grpc.SiteEngineStub(channel)
                ttl_ms = 60_000
                attacks = [
                    stub.KvRoom(site_pb2.KvRoomRequest()),
                    stub.LendKv(
                        site_pb2.LendKvRequest(
                            bytes=4 * MIB, lease_id=lease.id, lease_ttl_ms=ttl_ms
                        )
                    ),
                ]
                for attack in attacks:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await attack
                    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "loopback" in (refused.value.details() or "")
                assert await _blocks(gateway) == full
                # The gateway's lending, whose lease id the caller even knows, stays lent.
                assert await gateway.lend_kv(MIB, lease) >= MIB
                shrunk = await _blocks(gateway)
                for attack in [
                    stub.ReturnKv(site_pb2.ReturnKvRequest(lease_id=lease.id)),
                    stub.RenewKvLease(
                        site_pb2.RenewKvLeaseRequest(lease_id=lease.id, lease_ttl_ms=ttl_ms)
                    ),
                ]:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await attack
                    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert await _blocks(gateway) == shrunk
                # What is not lending is still served to it (the site's other calls).
                assert (await stub.Info(site_pb2.InfoRequest())).kv_blocks_total == shrunk
        finally:
            await gateway.return_kv(lease.id)
            await gateway.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def tls_site(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ManagedProcess, TestPki]]:
    pki = make_pki(tmp_path_factory.mktemp("pki"), other_clients=("aws-use1-2",))
    process = start_site(
        model_dir=tiny_llama_dir,
        site_name="tls-lender",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("tls-lender"),
        extra_args=["--kv-cache-mib", str(KV_CACHE_MIB)],
        env={**pki.site_env(), "SITE_GATEWAY_IDENTITY": "fedllm-gateway"},
    )
    yield process, pki
    process.stop()


def _client(pki: TestPki, port: int, cert: Path, key: Path) -> GrpcSiteClient:
    tls = SiteTls(pki.ca_cert.read_bytes(), cert.read_bytes(), key.read_bytes())
    return GrpcSiteClient("tls-lender", f"127.0.0.1:{port}", 30.0, tls, "localhost")


def test_over_mutual_tls_only_the_gateways_certificate_may_lend(
    tls_site: tuple[ManagedProcess, TestPki],
) -> None:
    process, pki = tls_site
    assert process.port is not None
    other_cert, other_key = pki.other_clients["aws-use1-2"]

    async def run() -> None:
        gateway = _client(pki, process.port or 0, pki.client_cert, pki.client_key)
        other_site = _client(pki, process.port or 0, other_cert, other_key)
        lease = _lease()
        try:
            full = await _blocks(other_site)  # a certificate of the CA: the site's other calls
            with pytest.raises(SiteCallError, match="PERMISSION_DENIED"):
                await other_site.lend_kv(4 * MIB, _lease())
            assert await _blocks(gateway) == full
            assert await gateway.lend_kv(MIB, lease) >= MIB
            shrunk = await _blocks(gateway)
            assert shrunk < full
            with pytest.raises(SiteCallError, match="SITE_GATEWAY_IDENTITY"):
                await other_site.return_kv(lease.id)
            assert await _blocks(gateway) == shrunk
            assert await gateway.return_kv(lease.id) > 0
            assert await _blocks(gateway) == full
        finally:
            await gateway.close()
            await other_site.close()

    asyncio.run(run())
