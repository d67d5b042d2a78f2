"""Calls of the batch API shared by the batch end-to-end tests."""

from __future__ import annotations

import time
from typing import Any

import httpx

FINAL = ("completed", "failed", "cancelled")


def item(custom_id: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """An item whose answer length is known: exactly max_tokens tokens."""
    return {
        "custom_id": custom_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


def wait_for(
    client: httpx.Client, batch_id: str, statuses: tuple[str, ...] = FINAL, timeout_s: float = 180
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.get(f"/v1/batches/{batch_id}")
        assert response.status_code == 200, response.text
        batch: dict[str, Any] = response.json()
        if batch["status"] in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.2)


def all_results(client: httpx.Client, batch_id: str, page: int = 5) -> list[dict[str, Any]]:
    """Every item's result, read page by page through the `after` cursor."""
    results: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": page, **({"after": after} if after else {})}
        response = client.get(f"/v1/batches/{batch_id}/results", params=params)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list"
        results.extend(body["data"])
        if not body["has_more"]:
            return results
        after = body["last_id"]
