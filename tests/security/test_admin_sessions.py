"""Finding 7: the admin cookie was a permanent credential (an HMAC of the token with a fixed
value): a copy kept after logout, or stolen from a browser, opened the dashboard and admin API
forever, on every replica; it was Secure only when the gateway saw https (never behind the load
balancer), and /admin/login could be guessed at without limit.

Through real gateways (two on one database, no sites needed): a captured cookie is dead after
logout on another replica and after the server-side session lifetime; off loopback the cookie is
Secure and pages carry HSTS; a client address that keeps failing sign-ins is made to wait, other
addresses are not.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from devtools.launch import start_gateway
from gateway.api.admin_auth import ADMIN_COOKIE
from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow
TOKEN = "admin-token-for-the-session-tests"
TTL_S = 4


@pytest.fixture(scope="module")
def replicas(
    start_federation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    env = {"GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_ADMIN_SESSION_TTL_S": str(TTL_S)}
    first: Federation = start_federation(live=[], dead=("aws-use1",), env=env)
    work = tmp_path_factory.mktemp("second")
    second = start_gateway(
        federation_file=first.gateway.log_path.parent / "federation.json",
        database_url=first.database_url,
        log_dir=work,
        env=env,
        expect_healthy_sites=0,
    )
    yield first.base_url, f"http://127.0.0.1:{second.port}"
    second.stop()


def sign_in(base_url: str, address: str = "127.0.0.1") -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=address)
    with httpx.Client(base_url=base_url, transport=transport, timeout=10) as client:
        return client.post("/admin/login", data={"token": TOKEN})


def operator_api(base_url: str, cookie: str) -> int:
    response = httpx.get(
        f"{base_url}/admin/api/overview", cookies={ADMIN_COOKIE: cookie}, timeout=10
    )
    return response.status_code


def test_a_captured_cookie_is_dead_after_logout_on_every_replica(replicas: tuple[str, str]) -> None:
    first, second = replicas
    captured = sign_in(first).cookies[ADMIN_COOKIE]
    assert operator_api(first, captured) == 200
    assert operator_api(second, captured) == 200
    out = httpx.post(
        f"{first}/admin/logout", cookies={ADMIN_COOKIE: captured}, timeout=10
    )  # the operator signs out; the attacker kept a copy
    assert out.status_code == 303
    assert operator_api(first, captured) == 401
    assert operator_api(second, captured) == 401


def test_a_session_ends_on_the_server_after_its_lifetime(replicas: tuple[str, str]) -> None:
    first, _ = replicas
    captured = sign_in(first).cookies[ADMIN_COOKIE]
    assert operator_api(first, captured) == 200
    time.sleep(TTL_S + 1)  # the browser's Max-Age is no part of it: the cookie is re-sent as is
    assert operator_api(first, captured) == 401


def test_failed_sign_ins_are_throttled_per_client_address(replicas: tuple[str, str]) -> None:
    _, second = replicas
    transport = httpx.HTTPTransport(local_address="127.0.0.3")
    with httpx.Client(base_url=second, transport=transport, timeout=10) as guesser:
        statuses = [
            guesser.post("/admin/login", data={"token": f"guess-{i}-guess-guess"}).status_code
            for i in range(8)
        ]
        assert statuses[:5] == [401] * 5
        assert set(statuses[5:]) == {429}
        held = guesser.post("/admin/login", data={"token": TOKEN})  # even the right one waits
        assert held.status_code == 429
        assert 0 < int(held.headers["retry-after"]) <= 60
        assert ADMIN_COOKIE not in held.cookies
    assert sign_in(second, address="127.0.0.4").status_code == 303  # another address is served


def test_off_loopback_the_cookie_is_secure_and_pages_carry_hsts(start_federation) -> None:
    public: Federation = start_federation(
        live=[], dead=("gcp-euw4",), env={"GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_HOST": "0.0.0.0"}
    )
    signed_in = sign_in(public.base_url)  # plain http, as the load balancer forwards it
    assert signed_in.status_code == 303
    cookie = signed_in.headers["set-cookie"]
    assert "Secure" in cookie
    assert "HttpOnly" in cookie
    assert "max-age=31536000" in signed_in.headers["strict-transport-security"]
    page = httpx.get(f"{public.base_url}/admin/login", timeout=10)
    assert "strict-transport-security" in page.headers
