"""API keys and their limits through the public HTTP API (a real gateway with
GATEWAY_REQUIRE_API_KEYS=true, a real site): the admin API needs the admin credential, bad and
revoked keys get 401, a burst over the limit gets 429 with Retry-After while the accepted
requests complete, token pre-charges are settled to the real counts, usage per key matches what
the clients were told, and the official openai client works with a key."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Federation, wait_until_written

pytestmark = pytest.mark.slow

ADMIN = "admin-token-for-the-tenancy-tests"
PROMPT = "The tenancy test begins"


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1"],
        env={"GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN},
    )


@pytest.fixture
def admin(federation: Federation) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=federation.base_url, headers=headers, timeout=60) as client:
        yield client


def new_key(admin: httpx.Client, name: str, **limits: int) -> dict[str, Any]:
    response = admin.post("/admin/api/keys", json={"name": name, **limits})
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def complete(base_url: str, key: str, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=60)


def usage(admin: httpx.Client, key_id: int) -> dict[str, Any]:
    """The key's usage as the admin API reports it, once the request log has written it."""
    wait_until_written(str(admin.base_url).rstrip("/"))
    response = admin.get(f"/admin/api/keys/{key_id}/usage", params={"window_s": 3600})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_admin_api_needs_the_admin_credential(federation: Federation) -> None:
    calls = [
        ("POST", "/admin/api/keys", {"name": "x"}),
        ("GET", "/admin/api/keys", None),
        ("DELETE", "/admin/api/keys/1", None),
        ("GET", "/admin/api/keys/1/usage", None),
    ]
    for headers in ({}, {"Authorization": "Bearer not-the-admin-token"}):
        for method, path, body in calls:
            response = httpx.request(
                method, federation.base_url + path, json=body, headers=headers, timeout=30
            )
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"]["code"] == "admin_credential_required"
    assert federation.query("SELECT count(*) FROM api_keys") == [(0,)]


def test_keys_are_shown_once_and_bad_or_revoked_keys_get_401(
    federation: Federation, admin: httpx.Client
) -> None:
    created = new_key(admin, "short-lived", requests_per_minute=100)
    key = created["key"]
    assert key.startswith("fk-")
    assert created["prefix"] == key[:11]
    listed = {k["id"]: k for k in admin.get("/admin/api/keys").json()["data"]}
    assert "key" not in listed[created["id"]]
    (stored,) = federation.query(f"SELECT key_hash FROM api_keys WHERE id = {created['id']}")
    assert key not in str(stored)

    base = federation.base_url
    for header in ({}, {"Authorization": "Bearer fk-not-a-real-key"}, {"Authorization": key}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            response = httpx.request(method, base + path, headers=header, json={}, timeout=30)
            assert response.status_code == 401, (header, path, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.get(f"{base}/v1/batches", timeout=30)
    assert response.status_code == 401

    assert complete(base, key).status_code == 200
    revoked = admin.delete(f"/admin/api/keys/{created['id']}")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None
    refused = complete(base, key)  # revocation takes effect at once
    assert refused.status_code == 401
    assert "revoked" in refused.json()["error"]["message"]
    assert admin.delete("/admin/api/keys/999999").status_code == 404


def test_burst_over_rpm_gets_429_with_retry_after_and_the_rest_complete(
    federation: Federation, admin: httpx.Client
) -> None:
    created = new_key(admin, "bursty", requests_per_minute=3, tokens_per_minute=100_000)
    with ThreadPoolExecutor(6) as pool:
        responses = list(
            pool.map(lambda _: complete(federation.base_url, created["key"]), range(6))
        )
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert (len(accepted), len(refused)) == (3, 3), [r.text for r in responses]
    for response in refused:
        error = response.json()["error"]
        assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
        assert 1 <= int(response.headers["retry-after"]) <= 60
    for response in accepted:
        body = response.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 8
    ids = sorted(r.json()["id"] for r in accepted)
    rows = federation.rows(f"r.api_key_id = {created['id']}")
    assert sorted(str(row["id"]) for row in rows) == ids  # refused requests left no trace
    assert {row["status"] for row in rows} == {"completed"}
    counted = usage(admin, created["id"])
    assert counted["requests"] == 3
    assert counted["prompt_tokens"] == sum(r.json()["usage"]["prompt_tokens"] for r in accepted)
    assert counted["completion_tokens"] == 24


def test_token_pre_charges_are_settled_to_the_real_counts(
    federation: Federation, admin: httpx.Client
) -> None:
    base = federation.base_url
    probe = new_key(admin, "probe")  # no limits: learns the prompt's size and a stop string
    full = complete(base, probe["key"], max_tokens=40).json()
    prompt_tokens = full["usage"]["prompt_tokens"]
    stop = full["choices"][0]["text"][:4]
    assert len(stop) == 4
    charge = prompt_tokens + 40  # no predictor here: the pre-charge is prompt + max_tokens
    # Two pre-charges do not fit together; a pre-charge next to a settled short answer does.
    tight = new_key(admin, "tight", tokens_per_minute=2 * charge - 1)
    short = [complete(base, tight["key"], max_tokens=40, stop=stop) for _ in range(2)]
    assert [r.status_code for r in short] == [200, 200], short[-1].text
    spent = sum(r.json()["usage"]["total_tokens"] for r in short)
    assert all(r.json()["usage"]["completion_tokens"] < 40 for r in short)
    room = 2 * charge - 1 - spent
    # One token more than the room left is refused, until the window moves on ...
    over = complete(base, tight["key"], max_tokens=room - prompt_tokens + 1)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["type"] == "tokens"
    assert 1 <= int(over.headers["retry-after"]) <= 60
    # ... and exactly the room left is admitted.
    exact = complete(base, tight["key"], max_tokens=room - prompt_tokens, ignore_eos=True)
    assert exact.status_code == 200, exact.text
    answers = [*short, exact]
    counted = usage(admin, tight["id"])
    assert counted["requests"] == 3
    assert counted["prompt_tokens"] == sum(r.json()["usage"]["prompt_tokens"] for r in answers)
    assert counted["completion_tokens"] == sum(
        r.json()["usage"]["completion_tokens"] for r in answers
    )
    assert counted["total_tokens"] == 2 * charge - 1  # exactly the limit, all of it real


def test_a_batch_is_admitted_whole_against_the_limits(
    federation: Federation, admin: httpx.Client
) -> None:
    created = new_key(admin, "batcher", requests_per_minute=3)
    headers = {"Authorization": f"Bearer {created['key']}"}
    items = [{"custom_id": f"i{n}", "prompt": PROMPT, "max_tokens": 2} for n in range(4)]
    with httpx.Client(base_url=federation.base_url, headers=headers, timeout=60) as client:
        too_big = client.post("/v1/batches", json={"model": "tiny", "requests": items})
        assert too_big.status_code == 429, too_big.text
        assert "this batch of 4 requests is too large" in too_big.json()["error"]["message"]
        accepted = client.post("/v1/batches", json={"model": "tiny", "requests": items[:3]})
        assert accepted.status_code == 200, accepted.text
        after = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert after.status_code == 429  # the batch took the key's three requests
    assert federation.query("SELECT count(*) FROM batches") == [(1,)]


def test_the_openai_client_with_a_key(federation: Federation, admin: httpx.Client) -> None:
    created = new_key(admin, "openai-sdk", requests_per_minute=2)
    exact = {"ignore_eos": True}  # answers of exactly max_tokens, to count them
    base_url = f"{federation.base_url}/v1"
    with openai.OpenAI(base_url=base_url, api_key=created["key"], max_retries=0) as client:
        assert [model.id for model in client.models.list()] == ["tiny"]
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            extra_body=exact,
        )
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 3
        stream = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, stream=True, extra_body=exact
        )
        finishes = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
        assert finishes[-1] == "length"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    with (
        openai.OpenAI(base_url=base_url, api_key="fk-wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()
    counted = usage(admin, created["id"])
    assert counted["requests"] == 2
    assert counted["completion_tokens"] == 6
