"""Making a client API key through a real gateway's admin API."""

from __future__ import annotations

import httpx


def make_key(base_url: str, admin_token: str, name: str, **limits: int) -> str:
    """A new key with `limits` (requests_per_minute, tokens_per_minute,
    max_concurrent_requests); its plaintext."""
    made = httpx.post(
        f"{base_url}/admin/api/keys",
        json={"name": name, **limits},
        headers={"Authorization": f"Bearer {admin_token}"},
        timeout=30,
    )
    assert made.status_code == 201, made.text
    assert all(made.json()[limit] == value for limit, value in limits.items())
    key: str = made.json()["key"]
    return key
