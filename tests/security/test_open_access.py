"""Finding 2: a deployment open by default. A gateway reachable beyond loopback serves only
callers with a live API key, unless the operator opts out loudly; the Terraform sets it and
refuses an opt-out. The attack: a client whose key is rate-limited omits the header and is
served anonymously, outside every limit."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from devtools.launch import free_port, start_gateway
from gateway.settings import GatewaySettings
from tests.e2e.conftest import Federation
from tests.infra.deployment import (
    addresses_for,
    render_root,
    tfvars,
    validation_failures,
    variable_values,
)
from tests.infra.gateway_render import gateway_container_env, gateway_secrets
from tests.infra.hcl_tree import ModuleConfig

pytestmark = pytest.mark.slow

ADMIN = "admin-token-for-the-open-access-tests"
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def public(start_federation) -> Federation:
    # What an operator writes: a public address and an admin token, nothing about keys.
    return start_federation(
        live=["aws-use1"], env={"GATEWAY_HOST": "0.0.0.0", "GATEWAY_ADMIN_TOKEN": ADMIN}
    )


def test_a_gateway_on_a_public_address_refuses_callers_without_a_key(public: Federation) -> None:
    for method, path, body in (
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", BODY),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ):
        response = httpx.request(method, public.base_url + path, json=body, timeout=30)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    made = httpx.post(
        f"{public.base_url}/admin/api/keys",
        json={"name": "k"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    ).json()
    served = httpx.post(
        f"{public.base_url}/v1/completions",
        json=BODY,
        headers={"Authorization": f"Bearer {made['key']}"},
        timeout=60,
    )
    assert served.status_code == 200, served.text


def test_a_public_address_without_keys_or_the_override_does_not_start(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "GATEWAY_FEDERATION_FILE": str(tmp_path / "federation.json"),
        "GATEWAY_HOST": "0.0.0.0",
        "GATEWAY_PORT": str(free_port()),
        "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'g.db'}",
    }
    env.pop("GATEWAY_ADMIN_TOKEN", None)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "gateway"], env=env, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the gateway kept running on 0.0.0.0 with no API keys required")
    assert run.returncode != 0
    assert "GATEWAY_REQUIRE_API_KEYS" in run.stderr
    assert "GATEWAY_ALLOW_OPEN_ACCESS" in run.stderr


def test_the_open_access_override_serves_without_keys_and_says_so(
    public: Federation, tmp_path: Path
) -> None:
    federation_file = Path(public.gateway.log_path).parent / "federation.json"
    gateway = start_gateway(
        federation_file=federation_file,
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'open.db'}",
        log_dir=tmp_path,
        env={"GATEWAY_HOST": "0.0.0.0", "GATEWAY_ALLOW_OPEN_ACCESS": "true"},
    )
    try:
        response = httpx.post(
            f"http://127.0.0.1:{gateway.port}/v1/completions", json=BODY, timeout=60
        )
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 5
        while "OPEN ACCESS" not in gateway.log_tail(200) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "WARNING" in gateway.log_tail(200)
        assert "OPEN ACCESS" in gateway.log_tail(200)
    finally:
        gateway.stop()


def test_the_terraform_gateway_requires_keys_and_refuses_an_opt_out(root: ModuleConfig) -> None:
    example = tfvars()
    rendered = render_root(root, example, addresses_for())
    env = gateway_container_env(root, rendered)
    assert env["GATEWAY_REQUIRE_API_KEYS"] == "true"
    settings = GatewaySettings.from_env({**env, **gateway_secrets(root, rendered)})
    assert settings.access.require_api_keys
    assert not settings.access.allow_open_access
    for override in ({"GATEWAY_ALLOW_OPEN_ACCESS": "true"}, {"GATEWAY_REQUIRE_API_KEYS": "false"}):
        given = copy.deepcopy(example)
        given["gateway"]["settings"] = override
        failures = validation_failures(root, variable_values(root, given))
        assert any("gateway.settings" in f for f in failures), (override, failures)
