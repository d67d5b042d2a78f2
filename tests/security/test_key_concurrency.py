"""Findings 4 and 5: one client could hold every in-flight slot. Token charges do not bound how
many long requests one key runs at once; a key's `max_concurrent_requests` (admin API) now
does: over it, 429 `concurrency_limit_exceeded` with Retry-After, and the slot comes back when
a request ends, a streaming client that goes away included.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import Federation
from tests.support.api_keys import make_key

pytestmark = pytest.mark.slow
ADMIN = "admin-token-for-the-concurrency-tests"
LONG = {"model": "tiny", "prompt": "Hi", "max_tokens": 300, "ignore_eos": True}


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1"], env={"GATEWAY_ADMIN_TOKEN": ADMIN, "GATEWAY_REQUIRE_API_KEYS": "true"}
    )


def capped_key(federation: Federation) -> dict[str, str]:
    key = make_key(federation.base_url, ADMIN, "one-at-a-time", max_concurrent_requests=1)
    return {"Authorization": f"Bearer {key}"}


def test_a_key_holds_at_most_its_cap_in_flight(federation: Federation) -> None:
    headers = capped_key(federation)
    url = f"{federation.base_url}/v1/completions"
    with ThreadPoolExecutor(3) as pool:
        answers = list(
            pool.map(lambda _: httpx.post(url, json=LONG, headers=headers, timeout=120), range(3))
        )
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200, 429, 429], [a.text[:200] for a in answers]
    refused = [a for a in answers if a.status_code == 429]
    assert {a.json()["error"]["code"] for a in refused} == {"concurrency_limit_exceeded"}
    assert all(a.headers["retry-after"] == "1" for a in refused)
    # The slot came back when the request ended.
    again = httpx.post(url, json={**LONG, "max_tokens": 2}, headers=headers, timeout=60)
    assert again.status_code == 200, again.text


def test_a_stream_whose_client_left_gives_its_slot_back(federation: Federation) -> None:
    headers = capped_key(federation)
    url = f"{federation.base_url}/v1/completions"
    with httpx.stream(
        "POST", url, json={**LONG, "stream": True}, headers=headers, timeout=60
    ) as stream:
        assert stream.status_code == 200
        next(stream.iter_bytes())  # reading has begun; then the client goes away
    deadline = time.monotonic() + 10
    while True:
        answer = httpx.post(url, json={**LONG, "max_tokens": 2}, headers=headers, timeout=60)
        if answer.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert answer.status_code == 200, answer.text
