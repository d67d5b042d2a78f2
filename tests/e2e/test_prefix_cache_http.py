"""Prefix caching through the public API: a real gateway with API keys in front of a real site.

A repeated prompt reports its cached tokens in `usage.prompt_tokens_details.cached_tokens`
(completions and chat, streamed and not); the cache is per API key unless the model's
federation entry shares it; a client's `cache_salt` splits its key's cache further and never
joins another key's; a non-string salt is refused with a 400 naming it; the dashboard's API shows
the site's hit rate from its load reports.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow

ADMIN = "admin-token-for-the-prefix-cache-tests"
# About 60 tokens with the GPT-2 tokenizer: three full blocks of 16 and some.
PROMPT = "Our shared system prompt says who the assistant is and how it answers. " * 4
ENV = {
    "GATEWAY_REQUIRE_API_KEYS": "true",
    "GATEWAY_ADMIN_TOKEN": ADMIN,
    "GATEWAY_LOAD_REPORT_INTERVAL_MS": "100",
}


@pytest.fixture(scope="module")
def per_key(start_federation) -> Federation:
    return start_federation(live=["aws-use1"], env=ENV)


@pytest.fixture(scope="module")
def shared(start_federation) -> Federation:
    return start_federation(live=["gcp-euw4"], env=ENV, model_options={"share_prefix_cache": True})


def keys(federation: Federation, *names: str) -> Iterator[str]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    for name in names:
        created = httpx.post(
            f"{federation.base_url}/admin/api/keys",
            json={"name": name},
            headers=headers,
            timeout=30,
        )
        assert created.status_code == 201, created.text
        yield created.json()["key"]


def complete(federation: Federation, key: str, prompt: str = PROMPT, **fields: Any) -> Any:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}
    response = httpx.post(
        f"{federation.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def cached(body: Any) -> int:
    tokens: int = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


def chat_stream_usage(federation: Federation, key: str) -> Any:
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{federation.base_url}/v1/chat/completions", json=body, headers=headers,
        timeout=60,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        events = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    return events[-1]["usage"]


def test_cached_tokens_are_per_key_and_salted(per_key: Federation) -> None:
    alice, bob = keys(per_key, "alice", "bob")
    first = complete(per_key, alice)
    assert cached(first) == 0
    prompt_tokens = first["usage"]["prompt_tokens"]
    again = complete(per_key, alice)
    assert 0 < cached(again) < prompt_tokens
    assert cached(again) % 16 == 0
    assert again["choices"] == first["choices"]
    assert cached(complete(per_key, bob)) == 0  # another key shares nothing
    # A client's salt splits its key's cache; the same salt under another key joins nothing.
    assert cached(complete(per_key, alice, cache_salt="project-x")) == 0
    assert cached(complete(per_key, alice, cache_salt="project-x")) == cached(again)
    assert cached(complete(per_key, bob, cache_salt="project-x")) == 0
    # Chat, streamed with usage: the second identical conversation of a key is cached.
    assert chat_stream_usage(per_key, bob)["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat_stream_usage(per_key, bob)["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("salt", [42, ["a"], {"k": "v"}, "x" * 257])
def test_a_bad_cache_salt_is_refused_naming_it(per_key: Federation, salt: Any) -> None:
    (key,) = keys(per_key, f"bad-salt-{type(salt).__name__}-{len(str(salt))}")
    headers = {"Authorization": f"Bearer {key}"}
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):  # fmt: skip
        response = httpx.post(
            per_key.base_url + path, json={**body, "cache_salt": salt}, headers=headers, timeout=30
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "cache_salt"


def test_a_shared_model_caches_across_keys_and_the_dashboard_shows_hits(
    shared: Federation,
) -> None:
    carol, dave = keys(shared, "carol", "dave")
    assert cached(complete(shared, carol)) == 0
    assert cached(complete(shared, dave)) > 0  # the opt-in: one system prompt for everyone
    assert cached(complete(shared, dave, cache_salt="mine")) == 0  # a salt still splits
    headers = {"Authorization": f"Bearer {ADMIN}"}
    deadline = time.monotonic() + 30
    while True:
        overview = httpx.get(
            f"{shared.base_url}/admin/api/overview", headers=headers, timeout=30
        ).json()
        (site,) = overview["sites"]
        if site["prefix_cache_hit_rate"] is not None and site["prefix_cache_hit_rate"] > 0:
            break
        assert time.monotonic() < deadline, site
        time.sleep(0.1)
    assert 0 < site["prefix_cache_hit_rate"] < 1
