"""Security through real processes: a gateway and a site speaking mutual TLS, a gateway without
the TLS settings refused by that site (503, not a hang), logs at DEBUG on both sides free of
prompts and secrets unless prompts are asked for, and the request size limit."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from devtools.launch import ManagedProcess, readiness, start_gateway, start_site
from tests.e2e.conftest import write_federation
from tests.support.tls_certs import TestPki, make_pki

pytestmark = pytest.mark.slow

SITE_DNS = "site-a.fedllm.internal"
ADMIN = "admin-secret-0b7e5d6c9a1f4e2d"
PROMPT = "Zanzibar quokka telegraph 7731"  # distinctive: found in a log only if it leaked


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    # The certificate names the site by DNS only: the gateway reaches it by IP, so it must be
    # told the name (tls_server_name) to accept it.
    return make_pki(tmp_path_factory.mktemp("pki"), server_dns=(SITE_DNS,), server_ips=())


@pytest.fixture(scope="module")
def site(
    pki: TestPki, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    process = start_site(
        model_dir=tiny_llama_dir,
        site_name="aws-use1",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("site"),
        env={**pki.site_env(), "SITE_LOG_LEVEL": "DEBUG"},
    )
    yield process
    process.stop()


def federation_file(directory: Path, model_dir: Path, site: ManagedProcess) -> Path:
    path = write_federation(
        directory / "federation.json", model_dir, {"aws-use1": f"127.0.0.1:{site.port}"}
    )
    data = json.loads(path.read_text())
    data["sites"][0]["tls_server_name"] = SITE_DNS
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def launch_gateway(
    site: ManagedProcess, tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., ManagedProcess]]:
    started: list[ManagedProcess] = []

    def launch(env: dict[str, str], healthy: int = 1) -> ManagedProcess:
        gateway = start_gateway(
            federation_file=federation_file(tmp_path, tiny_llama_dir, site),
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
            log_dir=tmp_path,
            env=env,
            expect_healthy_sites=healthy,
        )
        started.append(gateway)
        return gateway

    yield launch
    for process in started:
        process.stop()


def url(gateway: ManagedProcess, path: str) -> str:
    return f"http://127.0.0.1:{gateway.port}{path}"


def complete(gateway: ManagedProcess, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    return httpx.post(url(gateway, "/v1/completions"), json=body, headers=headers, timeout=30)


def test_a_gateway_with_its_client_certificate_serves_through_a_tls_site(
    launch_gateway, pki: TestPki
) -> None:
    gateway = launch_gateway(pki.gateway_env())
    response = complete(gateway)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 6
    assert response.headers["X-Fedllm-Site"] == "aws-use1"


def test_a_gateway_without_tls_settings_gets_503_from_a_tls_site_not_a_hang(
    launch_gateway,
) -> None:
    gateway = launch_gateway({}, healthy=0)
    time.sleep(1.5)  # a few health intervals (0.5 s): the site stays unhealthy
    assert readiness(gateway)["sites"] == {"aws-use1": False}
    started = time.monotonic()
    response = complete(gateway)
    assert time.monotonic() - started < 10
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"
    assert int(response.headers["Retry-After"]) >= 1
    assert "site aws-use1 is now unhealthy" in gateway.log_tail(100)


def _exercise(gateway: ManagedProcess) -> list[str]:
    """Real traffic carrying the prompt and every secret; returns the secrets it used."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    created = httpx.post(
        url(gateway, "/admin/api/keys"), json={"name": "log-test"}, headers=admin, timeout=30
    )
    assert created.status_code == 201, created.text
    key = created.json()["key"]
    bearer = {"Authorization": f"Bearer {key}"}
    assert complete(gateway, bearer).status_code == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    response = httpx.post(url(gateway, "/v1/chat/completions"), json=chat, headers=bearer)
    assert response.status_code == 200, response.text
    stream = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url(gateway, "/v1/completions"), json=stream, headers=bearer) as r:
        assert r.status_code == 200
        assert "[DONE]" in r.read().decode()
    wrong_key = "fk-notakey1f9d8c7b6a5e4d3c2b1a0f9e8d7c"  # our scheme: checked, refused
    assert complete(gateway, {"Authorization": f"Bearer {wrong_key}"}).status_code == 401
    wrong_admin = {"Authorization": "Bearer not-the-admin-token-5a4b3c2d1e"}
    assert httpx.get(url(gateway, "/admin/api/keys"), headers=wrong_admin).status_code == 401
    assert httpx.get(url(gateway, "/admin/api/keys"), headers=admin).status_code == 200
    return [ADMIN, key, wrong_key, wrong_admin["Authorization"].split()[1]]


def _key_material(pki: TestPki) -> list[str]:
    """The base64 lines of both private keys (any one of them in a log would be a leak)."""
    lines = pki.server_key.read_text().splitlines() + pki.client_key.read_text().splitlines()
    return [line for line in lines if line and not line.startswith("-----")]


def test_logs_at_debug_carry_no_prompt_and_no_secret(
    launch_gateway, site: ManagedProcess, pki: TestPki
) -> None:
    gateway = launch_gateway(
        {**pki.gateway_env(), "GATEWAY_LOG_LEVEL": "DEBUG", "GATEWAY_ADMIN_TOKEN": ADMIN}
    )
    secrets = _exercise(gateway)
    gateway.stop()  # flushes its log
    logs = {
        "gateway": gateway.log_path.read_text(),
        "site": site.log_path.read_text(),
    }
    # DEBUG is really on, on both sides (else the test would prove nothing).
    assert "DEBUG" in logs["gateway"]
    assert "DEBUG" in logs["site"]
    for where, text in logs.items():
        assert PROMPT not in text, f"the prompt is in the {where} log"
        for secret in secrets + _key_material(pki):
            assert secret not in text, f"a secret is in the {where} log"


def test_with_log_prompts_on_the_prompt_is_logged(launch_gateway, pki: TestPki) -> None:
    gateway = launch_gateway({**pki.gateway_env(), "GATEWAY_LOG_PROMPTS": "true"})
    assert complete(gateway).status_code == 200
    gateway.stop()
    assert PROMPT in gateway.log_path.read_text()


def test_a_body_over_max_body_bytes_gets_an_openai_shaped_413(launch_gateway, pki: TestPki) -> None:
    gateway = launch_gateway({**pki.gateway_env(), "GATEWAY_MAX_BODY_BYTES": "4096"})
    body = {"model": "tiny", "prompt": "word " * 1000, "max_tokens": 1}
    for path in ("/v1/completions", "/v1/chat/completions"):
        if path.endswith("chat/completions"):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 1000}]}
        response = httpx.post(url(gateway, path), json=body, timeout=30)
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
        assert error["message"]
    small = {"model": "tiny", "prompt": "word " * 500, "max_tokens": 1}  # ~2.5 kB: allowed
    assert httpx.post(url(gateway, "/v1/completions"), json=small, timeout=30).status_code == 200
