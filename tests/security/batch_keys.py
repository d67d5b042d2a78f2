"""What the batch attack tests share: a federation with keys required, keys made through the
admin API, and the batch API called with a key."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.e2e.batch_client import FINAL
from tests.e2e.conftest import Federation

ADMIN = "admin-token-for-the-batch-attack-tests"
KEYS_REQUIRED = {"GATEWAY_ADMIN_TOKEN": ADMIN, "GATEWAY_REQUIRE_API_KEYS": "true"}


def admin(federation: Federation) -> httpx.Client:
    return httpx.Client(
        base_url=federation.base_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
    )


def make_key(federation: Federation, name: str) -> dict[str, Any]:
    with admin(federation) as client:
        response = client.post("/admin/api/keys", json={"name": name})
    assert response.status_code == 201, response.text
    made: dict[str, Any] = response.json()
    return made


def client_of(federation: Federation, key: dict[str, Any]) -> httpx.Client:
    return httpx.Client(
        base_url=federation.base_url,
        headers={"Authorization": f"Bearer {key['key']}"},
        timeout=60,
    )


def long_items(count: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {"custom_id": f"i{i}", "prompt": f"Story {i}", "max_tokens": tokens, "ignore_eos": True}
        for i in range(count)
    ]


def wait_final(client: httpx.Client, batch_id: str, timeout_s: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        batch: dict[str, Any] = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in FINAL:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
