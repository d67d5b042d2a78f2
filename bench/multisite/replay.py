"""Submitting a workload to a gateway through its public HTTP API, all queries as one burst."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import httpx

from bench.multisite.workload import Query

SITE_HEADER = "x-fedllm-site"
# burst: every query its own /v1/completions request, all sent at once; batch: one /v1/batches job
Submission = Literal["burst", "batch"]


@dataclass(frozen=True, slots=True)
class Outcome:
    query_id: str
    status: int  # HTTP status; 0 when the request never got an answer
    site: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class BurstResult:
    outcomes: tuple[Outcome, ...]
    wall_s: float  # from the first submission to the last answer


def completion_body(model: str, query: Query) -> dict[str, object]:
    """Greedy, and exactly the reference answer's length: ignore_eos with max_tokens = it."""
    return {
        "model": model,
        "prompt": query.prompt,
        "max_tokens": query.answer_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


async def _one(
    client: httpx.AsyncClient,
    model: str,
    query: Query,
    on_done: Callable[[Outcome], None] | None,
) -> Outcome:
    started = time.perf_counter()
    try:
        response = await client.post("/v1/completions", json=completion_body(model, query))
    except httpx.HTTPError as exc:
        outcome = Outcome(query.id, 0, None, 0, 0, time.perf_counter() - started, repr(exc))
    else:
        latency = time.perf_counter() - started
        body = response.json()
        if response.status_code == 200:
            usage = body["usage"]
            outcome = Outcome(
                query.id,
                200,
                response.headers.get(SITE_HEADER),
                int(usage["prompt_tokens"]),
                int(usage["completion_tokens"]),
                latency,
            )
        else:
            message = str(body.get("error", {}).get("message", body))[:300]
            outcome = Outcome(query.id, response.status_code, None, 0, 0, latency, message)
    if on_done is not None:
        on_done(outcome)
    return outcome


async def burst(
    base_url: str,
    model: str,
    queries: Sequence[Query],
    *,
    timeout_s: float = 3600.0,
    on_done: Callable[[Outcome], None] | None = None,
) -> BurstResult:
    """Every query is sent at once (one connection each), in workload order; waits for all."""
    limits = httpx.Limits(max_connections=len(queries) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        started = time.perf_counter()
        tasks = []
        for query in queries:
            tasks.append(asyncio.create_task(_one(client, model, query, on_done)))
            await asyncio.sleep(0)  # let each request start in order
        outcomes = await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    return BurstResult(tuple(outcomes), wall)


class BatchApiError(RuntimeError):
    """The gateway's batch API refused the batch or did not settle it in time."""


def batch_item(query: Query) -> dict[str, object]:
    return {
        "custom_id": query.id,
        "prompt": query.prompt,
        "max_tokens": query.answer_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


async def _batch_outcomes(
    client: httpx.AsyncClient, batch_id: str, queries: Sequence[Query], wall_s: float
) -> list[Outcome]:
    by_id: dict[str, Outcome] = {}
    after: str | None = None
    while True:
        params: dict[str, str | int] = {"limit": 100, **({"after": after} if after else {})}
        response = await client.get(f"/v1/batches/{batch_id}/results", params=params)
        response.raise_for_status()
        page = response.json()
        for item in page["data"]:
            usage = (item.get("response") or {}).get("usage") or {}
            error = item.get("error")
            by_id[item["custom_id"]] = Outcome(
                item["custom_id"],
                200 if item["status"] == "completed" else 500,
                item["assignment"]["site"],
                int(usage.get("prompt_tokens", 0)),
                int(usage.get("completion_tokens", 0)),
                wall_s,
                None if item["status"] == "completed" else str(error)[:300],
            )
        if not page["has_more"]:
            break
        after = page["last_id"]
    missing = Outcome("", 0, None, 0, 0, wall_s, "no result for this item")
    return [by_id.get(q.id, replace(missing, query_id=q.id)) for q in queries]


async def batch(
    base_url: str, model: str, queries: Sequence[Query], *, timeout_s: float = 3600.0
) -> BurstResult:
    """The whole workload as one /v1/batches job (the gateway assigns it group-wise); waits
    until the batch settles. Latency is not per query here: each outcome carries the wall time."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        started = time.perf_counter()
        response = await client.post(
            "/v1/batches", json={"model": model, "requests": [batch_item(q) for q in queries]}
        )
        if response.status_code != 200:
            raise BatchApiError(f"batch refused: HTTP {response.status_code} {response.text[:300]}")
        batch_id = response.json()["id"]
        while True:
            status = (await client.get(f"/v1/batches/{batch_id}")).json()["status"]
            if status in ("completed", "failed", "cancelled"):
                break
            if time.perf_counter() - started > timeout_s:
                raise BatchApiError(f"batch {batch_id} still {status} after {timeout_s:.0f}s")
            await asyncio.sleep(0.1)
        wall = time.perf_counter() - started
        outcomes = await _batch_outcomes(client, batch_id, queries, wall)
    return BurstResult(tuple(outcomes), wall)
