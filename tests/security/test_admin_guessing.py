"""Issue 32, finding 2 (admin credential brute force) and the second half of finding 8 (admin
CSRF).

2. The sign-in form locked an address after 5 failures, but `Authorization: Bearer` on
   `/admin/api/*` and `/metrics` took ~84 guesses/s forever; and the lock-out could be turned
   against the operator: after 5 wrong sign-ins from one address, the right token was refused
   there for a minute, so anyone behind a shared address could keep the operator out.
8. Admin POSTs took a foreign `Origin` with a `text/plain` body (CSRF stopped by SameSite
   alone).

Issue 48, finding 3: `/readyz` showed anyone the sites' names and health, the drained sites,
the request log's backlog and the predictor's versions. Now it tells only `{"ready": ...}` with
its status, and the report is the operators' (`/admin/api/readiness`).

Issue 48, finding 1: uvicorn believed `X-Forwarded-For` from 127.0.0.1 (its default), so a
client coming through a proxy, tunnel or sidecar on the gateway's host guessed from a new
"address" each time (~85 guesses/s, never throttled), or named the operator's address to lock it
out.

Through a real gateway: every wrong admin credential counts (5 a minute per client, on every
replica); a browser that signed in before carries a signed device cookie, and its sign-ins
count on their own, so others' failures at its address do not lock it out; admin POSTs from
another origin get 403, and bodies that are not JSON 415. Forwarded headers count only from a
proxy the operator names (GATEWAY_TRUSTED_PROXIES), loopback included.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.api.admin_auth import ADMIN_COOKIE, DEVICE_COOKIE
from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow
TOKEN = "admin-token-for-the-guessing-tests"
WRONG = "a-wrong-guess-of-the-token"


# The address a trusted proxy of the second gateway connects from.
PROXY = "127.0.0.31"


@pytest.fixture(scope="module")
def gateway(start_federation) -> str:
    federation: Federation = start_federation(
        live=[], dead=("aws-use1",), env={"GATEWAY_ADMIN_TOKEN": TOKEN}
    )
    return federation.base_url


@pytest.fixture(scope="module")
def behind_proxy(start_federation) -> str:
    """A gateway whose operator named PROXY as the proxy in front of it."""
    federation: Federation = start_federation(
        live=[],
        dead=("aws-use1",),
        env={"GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_TRUSTED_PROXIES": f"{PROXY}, 10.9.0.0/16"},
    )
    return federation.base_url


METRICS_TOKEN = "metrics-reader-token-for-the-tests"


@pytest.fixture(scope="module")
def with_metrics_reader(start_federation) -> str:
    """A gateway with the read-only metrics credential its Prometheus scrapes with."""
    federation: Federation = start_federation(
        live=[],
        dead=("aws-use1",),
        env={"GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_ADMIN_METRICS_TOKEN": METRICS_TOKEN},
    )
    return federation.base_url


def _from(base_url: str, address: str) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=base_url, transport=transport, timeout=10)


def test_bearer_guesses_are_throttled_on_the_api_and_metrics(gateway: str) -> None:
    with _from(gateway, "127.0.0.21") as guesser:
        wrong = {"Authorization": f"Bearer {WRONG}"}
        statuses = [guesser.get("/admin/api/keys", headers=wrong).status_code for _ in range(3)]
        statuses += [guesser.get("/metrics", headers=wrong).status_code for _ in range(2)]
        assert statuses == [401] * 5
        held = guesser.get("/metrics", headers=wrong)
        assert held.status_code == 429, held.text
        assert held.json()["error"]["code"] == "admin_credential_throttled"
        assert 0 < int(held.headers["retry-after"]) <= 60
        # Not even tried while it waits: a guess cannot be told right from wrong.
        right = guesser.get("/admin/api/keys", headers={"Authorization": f"Bearer {TOKEN}"})
        assert right.status_code == 429
    with _from(gateway, "127.0.0.22") as operator:  # another address is served
        answer = operator.get("/admin/api/keys", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200, answer.text


def test_others_failures_at_its_address_do_not_lock_the_operator_out(gateway: str) -> None:
    with _from(gateway, "127.0.0.23") as operator:
        signed_in = operator.post("/admin/login", data={"token": TOKEN})
        assert signed_in.status_code == 303
        device = signed_in.cookies[DEVICE_COOKIE]
        operator.post("/admin/logout")
    with _from(gateway, "127.0.0.23") as neighbour:  # same address, no device cookie
        statuses = [
            neighbour.post("/admin/login", data={"token": WRONG}).status_code for _ in range(6)
        ]
        assert statuses == [401] * 5 + [429]
        forged = neighbour.post(
            "/admin/login", data={"token": TOKEN}, cookies={DEVICE_COOKIE: device[:-4] + "abcd"}
        )
        assert forged.status_code == 429  # a device cookie it made up counts as none
    with _from(gateway, "127.0.0.23") as operator:
        operator.cookies.set(DEVICE_COOKIE, device)
        back = operator.post("/admin/login", data={"token": TOKEN})
        assert back.status_code == 303, back.text
        assert ADMIN_COOKIE in back.cookies


def _operator_cookie(gateway: str) -> str:
    with _from(gateway, "127.0.0.24") as operator:
        cookie: str = operator.post("/admin/login", data={"token": TOKEN}).cookies[ADMIN_COOKIE]
    return cookie


def test_admin_posts_from_another_origin_or_not_json_are_refused(gateway: str) -> None:
    cookies = {ADMIN_COOKIE: _operator_cookie(gateway)}
    evil = {"Origin": "https://attacker.example"}
    plain = {"Content-Type": "text/plain"}
    body = '{"name": "csrf"}'
    with httpx.Client(base_url=gateway, cookies=cookies, timeout=10) as browser:
        forged = browser.post("/admin/api/keys", content=body, headers={**evil, **plain})
        assert forged.status_code == 403, forged.text
        assert forged.json()["error"]["code"] == "cross_origin_refused"
        drain = browser.post("/admin/api/sites/aws-use1/drain", headers=evil)
        assert drain.status_code == 403
        not_json = browser.post("/admin/api/keys", content=body, headers=plain)
        assert not_json.status_code == 415, not_json.text
        same_origin = {"Origin": gateway, "Content-Type": "application/json"}
        made = browser.post("/admin/api/keys", content=body, headers=same_origin)
        assert made.status_code == 201, made.text
        login = browser.post("/admin/login", data={"token": TOKEN}, headers=evil)
        assert login.status_code == 403
        assert browser.get("/admin/api/keys", headers=evil).status_code == 200  # reads are safe
    # A script with the bearer token and no Origin is no browser: served as before.
    with _from(gateway, "127.0.0.25") as script:
        made = script.post(
            "/admin/api/keys", json={"name": "script"}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert made.status_code == 201, made.text


def _guesses(client: httpx.Client, forwarded_for: list[str]) -> list[int]:
    wrong = {"Authorization": f"Bearer {WRONG}"}
    return [
        client.get("/metrics", headers={**wrong, "X-Forwarded-For": address}).status_code
        for address in forwarded_for
    ]


def test_forwarded_for_from_loopback_is_not_believed_by_default(gateway: str) -> None:
    """From 127.0.0.1 (uvicorn's own default trusted proxy): a new X-Forwarded-For per guess
    is the same client, and naming the operator's address does not lock the operator out."""
    operator_address = "127.0.0.26"
    with _from(gateway, "127.0.0.1") as guesser:
        assert _guesses(guesser, [operator_address] * 5) == [401] * 5
        assert _guesses(guesser, [f"198.51.100.{n}" for n in range(3)]) == [429] * 3
    with _from(gateway, operator_address) as operator:
        answer = operator.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200, answer.text


def test_forwarded_for_from_a_named_proxy_is_the_client(behind_proxy: str) -> None:
    with _from(behind_proxy, PROXY) as proxy:
        # Six clients behind the proxy, one guess each: each is counted on its own.
        assert _guesses(proxy, [f"203.0.113.{n}" for n in range(6)]) == [401] * 6
        # One client behind it guessing six times is held, and only that client.
        assert _guesses(proxy, ["203.0.113.50"] * 6) == [401] * 5 + [429]
        right = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": "203.0.113.51"}
        assert proxy.get("/metrics", headers=right).status_code == 200
    # Anyone else's X-Forwarded-For is still not believed, loopback or not.
    with _from(behind_proxy, "127.0.0.1") as other:
        assert _guesses(other, [f"192.0.2.{n}" for n in range(6)]) == [401] * 5 + [429]


def test_readiness_detail_is_for_operators_only(gateway: str) -> None:
    with _from(gateway, "127.0.0.27") as anyone:
        answer = anyone.get("/readyz")  # its only site is down: not ready
        assert (answer.status_code, answer.json()) == (503, {"ready": False})
        # /readyz takes no credential: the right token gets no more there, and a wrong one is
        # no guess (an open path must not let anyone lock out the address they share).
        right = anyone.get("/readyz", headers={"Authorization": f"Bearer {TOKEN}"})
        assert right.json() == {"ready": False}
        wrong = {"Authorization": f"Bearer {WRONG}"}
        assert {anyone.get("/readyz", headers=wrong).status_code for _ in range(6)} == {503}
        assert anyone.get("/admin/api/readiness").status_code == 401
    with _from(gateway, "127.0.0.28") as operator:
        report = operator.get("/admin/api/readiness", headers={"Authorization": f"Bearer {TOKEN}"})
    assert report.status_code == 200, report.text
    body = report.json()
    assert (body["ready"], body["sites"], body["database"]) == (False, {"aws-use1": False}, "ok")
    assert {"draining", "request_log", "predictor", "model_predictors"} <= set(body)
    with httpx.Client(base_url=gateway, timeout=10) as browser:  # a signed-in dashboard
        browser.cookies.set(ADMIN_COOKIE, _operator_cookie(gateway))
        assert browser.get("/admin/api/readiness").json()["sites"] == {"aws-use1": False}


def test_the_metrics_credential_opens_metrics_and_nothing_else(with_metrics_reader: str) -> None:
    """Issue 58: scraping /metrics needed the whole admin token. The metrics token reads
    /metrics alone; the admin token still does; guesses of either count as before."""
    reader = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    with _from(with_metrics_reader, "127.0.0.41") as scraper:
        scraped = scraper.get("/metrics", headers=reader)
        assert scraped.status_code == 200, scraped.text
        assert "# TYPE fedllm_gateway_" in scraped.text
        for path in ("/admin/api/keys", "/admin/api/readiness"):
            refused = scraper.get(path, headers=reader)
            assert refused.status_code == 401, (path, refused.text)
        refused = scraper.post("/admin/api/keys", headers=reader, json={"name": "x"})
        assert refused.status_code == 401
        admin = scraper.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert admin.status_code == 200
    with _from(with_metrics_reader, "127.0.0.42") as guesser:
        wrong = {"Authorization": f"Bearer {METRICS_TOKEN}x"}
        statuses = [guesser.get("/metrics", headers=wrong).status_code for _ in range(6)]
        assert statuses == [401] * 5 + [429]
        assert guesser.get("/metrics", headers=reader).status_code == 429  # not even tried
