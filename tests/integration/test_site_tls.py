"""A real site process serving mutual TLS: who gets in, who does not, and the gateway's own
client over the same port; plus the site's bounds on what one message may carry."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.launch import ManagedProcess, start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from fedllm_contract.request_options import RequestOptions
from gateway.settings import GatewaySettings
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import GenerateParams, HealthAnswer
from gateway.sites.tls import load_site_tls
from site_engine.grpc_server import MAX_RECEIVE_MESSAGE_BYTES, MAX_STOP_STRINGS
from tests.support.tls_certs import TestPki, make_pki

pytestmark = pytest.mark.slow
SITE_DNS = "site-a.fedllm.internal"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"), server_dns=("localhost", SITE_DNS))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("other-pki"), ca_name="someone else's CA")


@pytest.fixture(scope="module")
def site(
    pki: TestPki, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    process = start_site(
        model_dir=tiny_llama_dir,
        site_name="tls-test",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("logs"),
        env=pki.site_env(),
    )
    yield process
    process.stop()


def credentials(
    ca: Path, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


def info(channel: grpc.Channel) -> site_pb2.SiteInfo:
    return site_pb2_grpc.SiteEngineStub(channel).Info(site_pb2.InfoRequest(), timeout=10)


def test_a_client_with_a_certificate_of_the_ca_is_served_health_included(
    site: ManagedProcess, pki: TestPki
) -> None:
    creds = credentials(pki.ca_cert, pki.client_cert, pki.client_key)
    with grpc.secure_channel(f"localhost:{site.port}", creds) as channel:
        assert info(channel).site_name == "tls-test"
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="fedllm.site.v1.SiteEngine"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = site_pb2.GenerateRequest(
            request_id="tls-1", prompt="Hello", sampling=site_pb2.SamplingParams(max_tokens=4)
        )
        chunks = list(site_pb2_grpc.SiteEngineStub(channel).Generate(request, timeout=60))
        assert chunks[-1].usage.completion_tokens == 4


def _refused(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        info(channel)
    return caught.value


def test_a_client_without_a_certificate_is_refused(site: ManagedProcess, pki: TestPki) -> None:
    with grpc.secure_channel(f"localhost:{site.port}", credentials(pki.ca_cert)) as channel:
        assert _refused(channel).code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_of_another_ca_is_refused(
    site: ManagedProcess, pki: TestPki, other_pki: TestPki
) -> None:
    # It trusts the site (the right CA), but its own certificate is signed by another CA.
    creds = credentials(pki.ca_cert, other_pki.client_cert, other_pki.client_key)
    with grpc.secure_channel(f"localhost:{site.port}", creds) as channel:
        assert _refused(channel).code() == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_is_refused(site: ManagedProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{site.port}") as channel:
        assert _refused(channel).code() == grpc.StatusCode.UNAVAILABLE


def _gateway_client(site: ManagedProcess, pki: TestPki, server_name: str | None) -> GrpcSiteClient:
    settings = GatewaySettings.from_env({"GATEWAY_FEDERATION_FILE": "f.json", **pki.gateway_env()})
    return GrpcSiteClient(
        "tls-test", f"127.0.0.1:{site.port}", 5.0, load_site_tls(settings), server_name
    )


def test_the_gateway_client_calls_health_info_load_and_generate_over_mtls(
    site: ManagedProcess, pki: TestPki
) -> None:
    async def run() -> None:
        client = _gateway_client(site, pki, SITE_DNS)
        try:
            assert await client.check_health()
            assert (await client.info()).site_name == "tls-test"
            reports = client.load_reports(50)
            report = await anext(reports)
            await reports.aclose()
            assert report.sequence >= 1
            params = GenerateParams("tls-2", (15496, 11), 3, RequestOptions(temperature=0))
            chunks = [chunk async for chunk in client.generate(params, timeout_s=60)]
            assert chunks[-1].completion_tokens == 3
        finally:
            await client.close()

    asyncio.run(run())


def test_the_site_certificate_must_carry_the_configured_server_name(
    site: ManagedProcess, pki: TestPki
) -> None:
    async def run() -> HealthAnswer:
        client = _gateway_client(site, pki, "another-site.fedllm.internal")
        try:
            return await client.check_health()
        finally:
            await client.close()

    # Refused, not merely unanswered: the monitor marks the site down at once.
    assert asyncio.run(run()) is HealthAnswer.REFUSED


def test_an_oversized_message_is_refused_and_the_site_keeps_serving(
    site: ManagedProcess, pki: TestPki
) -> None:
    creds = credentials(pki.ca_cert, pki.client_cert, pki.client_key)
    with grpc.secure_channel(f"localhost:{site.port}", creds) as channel:
        stub = site_pb2_grpc.SiteEngineStub(channel)
        huge = site_pb2.GenerateRequest(
            request_id="huge",
            prompt="x" * (MAX_RECEIVE_MESSAGE_BYTES + 1024),
            sampling=site_pb2.SamplingParams(max_tokens=1),
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(huge, timeout=30))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        too_many_stops = site_pb2.GenerateRequest(
            request_id="stops",
            prompt="Hello",
            sampling=site_pb2.SamplingParams(
                max_tokens=1, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
            ),
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(too_many_stops, timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        fine = site_pb2.GenerateRequest(
            request_id="after-huge", prompt="Hello", sampling=site_pb2.SamplingParams(max_tokens=2)
        )
        assert list(stub.Generate(fine, timeout=60))[-1].usage.completion_tokens == 2
    assert site.alive()
