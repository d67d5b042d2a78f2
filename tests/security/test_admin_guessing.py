"""Issue 32, finding 2 (admin credential brute force) and the second half of finding 8 (admin
CSRF).

2. The sign-in form locked an address after 5 failures, but `Authorization: Bearer` on
   `/admin/api/*` and `/metrics` took ~84 guesses/s forever; and the lock-out could be turned
   against the operator: after 5 wrong sign-ins from one address, the right token was refused
   there for a minute, so anyone behind a shared address could keep the operator out.
8. Admin POSTs took a foreign `Origin` with a `text/plain` body (CSRF stopped by SameSite
   alone).

Through a real gateway: every wrong admin credential counts (5 a minute per client, on every
replica); a browser that signed in before carries a signed device cookie, and its sign-ins
count on their own, so others' failures at its address do not lock it out; admin POSTs from
another origin get 403, and bodies that are not JSON 415.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.api.admin_auth import ADMIN_COOKIE, DEVICE_COOKIE
from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow
TOKEN = "admin-token-for-the-guessing-tests"
WRONG = "a-wrong-guess-of-the-token"


@pytest.fixture(scope="module")
def gateway(start_federation) -> str:
    federation: Federation = start_federation(
        live=[], dead=("aws-use1",), env={"GATEWAY_ADMIN_TOKEN": TOKEN}
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
    script = httpx.post(
        f"{gateway}/admin/api/keys",
        json={"name": "script"},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert script.status_code == 201, script.text
