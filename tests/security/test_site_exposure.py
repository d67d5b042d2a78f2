"""Finding 6: the site image listened in plaintext on 0.0.0.0 and queued without bound.

Anyone who reached a plaintext site's port could generate for free or release and cancel others'
queued requests: a site on a non-loopback address now refuses to start without mutual TLS unless
told otherwise (SITE_ALLOW_PLAINTEXT / --allow-plaintext). And one client could fill a site's
queue without end: the waiting queue is bounded (SITE_MAX_QUEUED_REQUESTS), the request over it
gets RESOURCE_EXHAUSTED, and the gateway tries another site, else answers 503 with Retry-After,
without marking the (healthy) site down.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from devtools.launch import ManagedProcess, readiness, start_gateway, start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from site_engine.settings import SettingsError, SiteSettings
from tests.e2e.conftest import write_federation

pytestmark = pytest.mark.slow
QUEUE = 2


def test_a_site_on_a_public_address_without_tls_does_not_start(tiny_llama_dir: Path) -> None:
    args = ["-m", "site_engine", "--model", str(tiny_llama_dir), "--host", "0.0.0.0"]
    try:
        run = subprocess.run(
            [sys.executable, *args, "--port", "0"], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the site served plaintext on 0.0.0.0")
    assert run.returncode != 0
    assert "SITE_ALLOW_PLAINTEXT" in run.stderr
    assert "READY" not in run.stdout


def test_the_plaintext_override_is_explicit() -> None:
    SiteSettings.load({}, model_dir="m", host="0.0.0.0", allow_plaintext=True)
    SiteSettings.load({"SITE_ALLOW_PLAINTEXT": "true"}, model_dir="m", host="0.0.0.0")
    SiteSettings.load({}, model_dir="m", host="127.0.0.1")
    with pytest.raises(SettingsError, match="SITE_ALLOW_PLAINTEXT"):
        SiteSettings.load({"SITE_ALLOW_PLAINTEXT": "false"}, model_dir="m", host="0.0.0.0")


@pytest.fixture(scope="module")
def site(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    process = start_site(
        model_dir=tiny_llama_dir,
        site_name="aws-use1",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("site"),
        extra_args=["--max-num-seqs", "1", "--max-queued-requests", str(QUEUE)],
    )
    yield process
    process.stop()


def _long(request_id: str) -> site_pb2.GenerateRequest:
    sampling = site_pb2.SamplingParams(max_tokens=900, ignore_eos=True)
    return site_pb2.GenerateRequest(request_id=request_id, prompt="Hello", sampling=sampling)


def test_a_full_site_queue_refuses_with_resource_exhausted(site: ManagedProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{site.port}") as channel:
        stub = site_pb2_grpc.SiteEngineStub(channel)
        held, refused = [], []
        for index in range(1 + QUEUE + 3):  # one running, QUEUE waiting, then the flood
            call = stub.Generate(_long(f"flood-{index}"))
            try:
                assert next(call).accepted
                held.append(call)
            except grpc.RpcError as exc:
                refused.append(exc.code())
        assert len(held) == 1 + QUEUE
        assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
        for call in held:
            call.cancel()
        # The bound is on what waits, not a ban: freed, the site takes work again.
        fine = site_pb2.GenerateRequest(
            request_id="after", prompt="Hi", sampling=site_pb2.SamplingParams(max_tokens=2)
        )
        assert list(stub.Generate(fine))[-1].finish_reason == site_pb2.FINISH_REASON_LENGTH


def test_the_gateway_answers_503_for_a_full_site_and_keeps_it_healthy(
    site: ManagedProcess, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    gateway = start_gateway(
        federation_file=write_federation(
            tmp_path / "federation.json", tiny_llama_dir, {"aws-use1": f"127.0.0.1:{site.port}"}
        ),
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
        log_dir=tmp_path,
        # The gateway's own queue bound off: the site's bound is what is tested.
        env={"GATEWAY_SITE_MAX_QUEUED_REQUESTS": "0"},
    )
    base = f"http://127.0.0.1:{gateway.port}"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 300, "ignore_eos": True}

    def first_status(_: int) -> tuple[int, str | None]:
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        return response.status_code, response.headers.get("retry-after")

    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(first_status, range(8)))
        refused = [a for a in answers if a[0] == 503]
        assert refused, answers
        assert all(retry_after is not None for _, retry_after in refused)
        assert {status for status, _ in answers} <= {200, 503}
        ready = readiness(gateway)
        assert ready["sites"]["aws-use1"], ready
    finally:
        gateway.stop()
