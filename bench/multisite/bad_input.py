"""Bad input through the public API of a running gateway: each check sends one request and
says whether the answer was the expected OpenAI-shaped error, and that nothing was created.

The batch checks run only when the gateway serves /v1/batches (its OpenAPI document says so);
otherwise they are reported as not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    expected_status: tuple[int, ...]
    status: int
    error_code: str | None
    message: str
    unchanged: bool  # nothing the request could have created exists afterwards

    @property
    def passed(self) -> bool:
        return (
            self.status in self.expected_status and self.error_code is not None and self.unchanged
        )

    def to_json(self) -> dict[str, object]:
        return {
            "check": self.name,
            "expected_status": list(self.expected_status),
            "status": self.status,
            "error_code": self.error_code,
            "message": self.message[:200],
            "unchanged": self.unchanged,
            "passed": self.passed,
        }


def _error(response: httpx.Response) -> tuple[str | None, str]:
    try:
        error = response.json().get("error", {})
    except ValueError:
        return None, response.text[:200]
    if not isinstance(error, dict):
        return None, str(error)[:200]
    code = error.get("code") or error.get("type")
    return (str(code) if code else None), str(error.get("message", ""))


def _batch_count(client: httpx.Client) -> int:
    response = client.get("/v1/batches", params={"limit": 100})
    response.raise_for_status()
    return len(response.json()["data"])


def serves_batches(base_url: str) -> bool:
    """Whether the gateway's OpenAPI document lists /v1/batches."""
    response = httpx.get(f"{base_url}/schema/openapi.json", timeout=30)
    return response.status_code == 200 and "/v1/batches" in response.json().get("paths", {})


def _batch_check(
    client: httpx.Client, name: str, body: dict[str, object], expected: tuple[int, ...]
) -> Check:
    before = _batch_count(client)
    response = client.post("/v1/batches", json=body)
    code, message = _error(response)
    return Check(
        name, expected, response.status_code, code, message, _batch_count(client) == before
    )


def run_checks(
    base_url: str, live_model: str, dead_model: str, batch_limit: int
) -> dict[str, object]:
    """`batch_limit` is the gateway's GATEWAY_BATCH_MAX_ITEMS."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        response = client.post(
            "/v1/completions", json={"model": dead_model, "prompt": "hello", "max_tokens": 4}
        )
        code, message = _error(response)
        checks = [
            Check(
                f"no healthy site serves {dead_model!r}",
                (503,),
                response.status_code,
                code,
                message,
                unchanged=True,  # a 503 creates nothing but its own failed request record
            )
        ]
        batches = serves_batches(base_url)
        if batches:
            item = {"prompt": "hello", "max_tokens": 4}
            checks.append(
                _batch_check(client, "empty batch", {"model": live_model, "requests": []}, (400,))
            )
            too_many = [{"custom_id": f"r{i}", **item} for i in range(batch_limit + 1)]
            checks.append(
                _batch_check(
                    client,
                    f"batch of {batch_limit + 1} requests, limit {batch_limit}",
                    {"model": live_model, "requests": too_many},
                    (400, 413),
                )
            )
    return {
        "batch_api": "checked" if batches else "not served by this gateway build: not checked",
        "checks": [c.to_json() for c in checks],
        "all_passed": all(c.passed for c in checks),
    }
