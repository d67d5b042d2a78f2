"""The four fault scenarios, each on a running Cluster, each returning its figures.

The tests (tests/fault/test_*.py) assert on these figures; `python -m bench.faults` runs the
same functions and writes them to bench/results/faults/faults.{json,md}. A scenario only drives the
public HTTP API and real processes, and reports what the clients saw.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import httpx

from devtools.faults.client import Result, Tally, complete
from devtools.faults.cluster import Cluster

CLIENT_TIMEOUT_S = 90.0


def _client(cluster: Cluster) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=cluster.base_url, timeout=CLIENT_TIMEOUT_S)


async def idempotency_supported(cluster: Cluster) -> bool:
    """Probes the API: two identical POSTs with one Idempotency-Key get one answer (same id)."""
    key = f"probe-{uuid.uuid4().hex}"
    async with _client(cluster) as client:
        ids = []
        for _ in range(2):
            result = await complete(
                client, "idempotency probe", 4, stream=False, headers={"Idempotency-Key": key}
            )
            ids.append(result.request_id)
    return ids[0] is not None and ids[0] == ids[1]


# -- (a) a site killed while it streams ------------------------------------------------------


async def kill_site_mid_stream(
    cluster: Cluster, victim: str = "site-a", streams: int = 6, plain: int = 2, tokens: int = 300
) -> dict[str, Any]:
    """Streams (and plain requests) spread over the sites; once every stream has produced
    tokens, the victim site is SIGKILLed. Streams elsewhere must be untouched; those on the
    victim must go on elsewhere (or end in a retryable error)."""
    tally = Tally()
    started: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(streams)}

    def on_token(index: int) -> Any:
        def mark(result: Result) -> None:
            if result.tokens_seen >= 10:
                started[index].set()

        return mark

    prompts = [f"Fault test story number {i} begins" for i in range(streams + plain)]
    async with _client(cluster) as client:
        tasks = [
            asyncio.create_task(
                complete(client, prompts[i], tokens, stream=True, on_token=on_token(i))
            )
            for i in range(streams)
        ] + [
            asyncio.create_task(complete(client, prompts[streams + i], tokens, stream=False))
            for i in range(plain)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 120)
        await asyncio.to_thread(cluster.kill_site, victim)
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks)
        for result in results:
            tally.add(result)
        # Greedy answers are deterministic: what the victim's streams ended with is compared
        # with the same prompt answered from scratch by a live site.
        same_text = 0
        victim_streams = [(i, r) for i, r in enumerate(results[:streams]) if r.site == victim]
        for i, result in victim_streams:
            if result.outcome == "completed":
                reference = await complete(client, prompts[i], tokens, stream=False)
                same_text += reference.text == result.text
    on_victim = [r for r in results if r.site == victim]
    elsewhere = [r for r in results if r.site != victim]
    return {
        "scenario": "kill a site mid-stream",
        "fault": f"SIGKILL {victim} while {streams} streams + {plain} plain requests of "
        f"{tokens} tokens run on {len(cluster.site_names)} sites",
        **tally.summary(),
        "on_victim": len(on_victim),
        "on_victim_completed": sum(r.outcome == "completed" for r in on_victim),
        "elsewhere": len(elsewhere),
        "elsewhere_completed": sum(r.outcome == "completed" for r in elsewhere),
        "victim_streams_same_text_as_reference": f"{same_text}/{len(victim_streams)}",
        "seconds_after_kill_to_last_answer": round(time.monotonic() - killed_at, 2),
        "lost_detail": tally.lost_detail(),
    }


# -- (b) the gateway killed and started again on the same database ---------------------------


def _batch_items(count: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"item-{i}",
            "prompt": f"Batch item {i} of the restart test",
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        for i in range(count)
    ]


async def _batch_progress(client: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/batches/{batch_id}")
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


async def _batch_results(client: httpx.AsyncClient, batch_id: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 100, **({"after": after} if after else {})}
        response = await client.get(f"/v1/batches/{batch_id}/results", params=params)
        response.raise_for_status()
        body = response.json()
        results.extend(body["data"])
        if not body["has_more"]:
            return results
        after = body["last_id"]


async def kill_gateway_and_restart(
    cluster: Cluster,
    in_flight: int = 4,
    batch_items: int = 20,
    tokens: int = 256,
    in_flight_tokens: int = 900,
) -> dict[str, Any]:
    """Streams, plain requests and a batch are in flight when the gateway is SIGKILLed; two
    more requests arrive while it is down; it is started again on the same database and port.
    Interrupted clients retry (plain ones with their Idempotency-Key; the gateway refuses keys
    on streams); the batch resumes by itself."""
    idempotent = await idempotency_supported(cluster)
    tally = Tally()
    prompts = [f"Gateway restart request {i}" for i in range(in_flight)]
    streaming = [i % 2 == 0 for i in range(in_flight)]
    keys = [
        {} if streaming[i] else {"Idempotency-Key": f"restart-{uuid.uuid4().hex}"}
        for i in range(in_flight)
    ]
    started = asyncio.Event()
    replay: dict[str, Any] = {"idempotency_key_supported": idempotent}

    def mark(result: Result) -> None:
        if result.tokens_seen >= 5:
            started.set()

    async with _client(cluster) as client:
        # Answered before the crash: a retry with its key must replay it, not run it again.
        before_key = {"Idempotency-Key": f"done-{uuid.uuid4().hex}"}
        before = await complete(
            client, "answered before the crash", 16, stream=False, headers=before_key
        )
        response = await client.post(
            "/v1/batches", json={"model": "tiny", "requests": _batch_items(batch_items, tokens)}
        )
        response.raise_for_status()
        batch_id = response.json()["id"]
        deadline = time.monotonic() + 120
        while (await _batch_progress(client, batch_id))["request_counts"]["completed"] < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("no batch item finished within 120 s")
            await asyncio.sleep(0.1)
        tasks = [
            asyncio.create_task(
                complete(
                    client,
                    prompts[i],
                    in_flight_tokens,  # long answers: still running when the gateway dies
                    stream=streaming[i],
                    headers=keys[i],
                    on_token=mark,
                    cut_is_retryable=True,  # the gateway is killed under them
                )
            )
            for i in range(in_flight)
        ]
        waiting = asyncio.create_task(started.wait())
        await asyncio.wait([waiting, *tasks], timeout=120, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        early = [t.result() for t in tasks if t.done()]
        if early:
            raise AssertionError(f"requests ended before the kill: {early}")
        await asyncio.sleep(0.3)  # the plain ones are generating too by now
        progress = await _batch_progress(client, batch_id)
        await asyncio.to_thread(cluster.kill_gateway)
        interrupted = await asyncio.gather(*tasks)
        for result in interrupted:
            tally.add(result)
        down = await asyncio.gather(
            *(complete(client, f"sent while down {i}", 8, stream=bool(i)) for i in range(2))
        )
        for result in down:
            tally.add(result)

    restart_started = time.monotonic()
    await asyncio.to_thread(cluster.start_gateway)
    restart_s = time.monotonic() - restart_started
    retries = Tally()
    async with _client(cluster) as client:
        for i, result in enumerate(interrupted):
            if result.outcome == "retryable":
                retries.add(
                    await complete(
                        client, prompts[i], in_flight_tokens, stream=streaming[i], headers=keys[i]
                    )
                )
        for i in range(len(down)):
            retries.add(await complete(client, f"sent while down {i}", 8, stream=bool(i)))
        again = await complete(
            client, "answered before the crash", 16, stream=False, headers=before_key
        )
        replay["replayed_same_answer"] = (
            again.request_id == before.request_id and again.text == before.text
        )
        deadline = time.monotonic() + 240
        while True:
            batch = await _batch_progress(client, batch_id)
            if batch["status"] in ("completed", "failed", "cancelled"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch never finished after the restart: {batch}")
            await asyncio.sleep(0.3)
        items = await _batch_results(client, batch_id)
    item_statuses = Counter(str(item["status"]) for item in items)
    whole = sum(
        1
        for item in items
        if item["status"] == "completed"
        and item["response"]["usage"]["completion_tokens"] == tokens
    )
    rows = cluster.query(
        "SELECT custom_id, count(*) FROM batch_items WHERE batch_id = :b GROUP BY custom_id",
        b=batch_id,
    )
    return {
        "scenario": "kill the gateway, restart it on the same database",
        "fault": f"SIGKILL the gateway with {in_flight} requests and a {batch_items}-item batch "
        "in flight; 2 requests sent while it is down; restart on the same PostgreSQL",
        **tally.summary(),
        "retried": retries.sent,
        "retries_saw": retries.summary()["client_saw"],
        "retried_lost": retries.count("lost"),
        "retry_lost_detail": retries.lost_detail(),
        "gateway_restart_s": round(restart_s, 2),
        "batch_done_before_kill": progress["request_counts"]["completed"],
        "batch_status": batch["status"],
        "batch_items": len(items),
        "batch_items_completed_whole": whole,
        "batch_item_statuses": dict(item_statuses),
        "batch_item_rows_per_custom_id": sorted({int(str(n)) for _, n in rows}),
        **replay,
        "lost_detail": tally.lost_detail(),
    }


# -- (c) a site's load reports stall ---------------------------------------------------------


async def stall_site(
    cluster: Cluster, victim: str = "site-a", stale_s: float = 2.0, every_s: float = 0.1
) -> dict[str, Any]:
    """The victim is SIGSTOPped for stale_s + 3 s, then SIGCONTed, while a new short request is
    sent every `every_s` (open loop: a request held by the frozen site holds up no other).
    Once the gateway marks the victim unhealthy, nothing new may go to it; every request
    completes (those it held when it froze finish after SIGCONT)."""
    tally = Tally()
    sent: list[tuple[float, asyncio.Task[Result]]] = []
    stop = asyncio.Event()

    async def sender(client: httpx.AsyncClient) -> None:
        n = 0
        while not stop.is_set():
            request = complete(client, f"stall request {n}", 8, stream=n % 2 == 1)
            sent.append((time.monotonic(), asyncio.create_task(request)))
            n += 1
            await asyncio.sleep(every_s)

    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(
        base_url=cluster.base_url, timeout=CLIENT_TIMEOUT_S, limits=limits
    ) as client:
        sending = asyncio.create_task(sender(client))
        await asyncio.sleep(2.0)
        frozen_at = time.monotonic()
        await asyncio.to_thread(cluster.freeze, victim)
        unhealthy_at = await asyncio.to_thread(cluster.wait_site_health, victim, False, 30.0)
        await asyncio.sleep(max(0.0, frozen_at + stale_s + 3.0 - time.monotonic()))
        await asyncio.to_thread(cluster.thaw, victim)
        thawed_at = time.monotonic()
        healthy_at = await asyncio.to_thread(cluster.wait_site_health, victim, True, 60.0)
        await asyncio.sleep(2.0)
        stop.set()
        await sending
        done = [(at, await task) for at, task in sent]
    for _, result in done:
        tally.add(result)
    while_unhealthy = [r for at, r in done if unhealthy_at <= at < thawed_at]
    held = [r for at, r in done if frozen_at <= at < unhealthy_at and r.site == victim]
    after = [r for at, r in done if at >= healthy_at]
    return {
        "scenario": "stall a site's load reports",
        "fault": f"SIGSTOP {victim} for {stale_s + 3:.0f} s "
        f"(GATEWAY_LOAD_REPORT_STALE_S={stale_s:g}), then SIGCONT; a request every "
        f"{every_s:g} s",
        **tally.summary(),
        "seconds_to_unhealthy": round(unhealthy_at - frozen_at, 2),
        "sent_while_unhealthy": len(while_unhealthy),
        "sent_while_unhealthy_to_victim": sum(r.site == victim for r in while_unhealthy),
        "victim_requests_s_after_sigstop": [
            round(at - frozen_at, 2) for at, r in done if r.site == victim and at >= frozen_at
        ][:20],
        "held_by_frozen_site": len(held),
        "held_completed": sum(r.outcome == "completed" for r in held),
        "max_latency_s": round(max(r.latency_s for _, r in done), 2),
        "seconds_to_healthy_after_sigcont": round(healthy_at - thawed_at, 2),
        "sent_after_recovery_to_victim": sum(r.site == victim for r in after),
        "lost_detail": tally.lost_detail(),
    }


# -- (d) the database connection drops -------------------------------------------------------


async def drop_database(
    cluster: Cluster, workers: int = 4, block_s: float = 2.0, seconds: float = 14.0
) -> dict[str, Any]:
    """Clients keep sending while the gateway's PostgreSQL backends are terminated twice, then
    terminated with new connections refused for block_s."""
    tally = Tally()
    stop = asyncio.Event()
    terminated: list[int] = []

    async def worker(index: int, client: httpx.AsyncClient) -> None:
        n = 0
        while not stop.is_set():
            result = await complete(client, f"db worker {index} request {n}", 24, stream=n % 2 == 0)
            tally.add(result)
            await result.back_off()
            n += 1

    async def faults() -> None:
        await asyncio.sleep(3.0)
        terminated.append(await asyncio.to_thread(cluster.drop_database_connections))
        await asyncio.sleep(3.0)
        terminated.append(await asyncio.to_thread(cluster.drop_database_connections))
        await asyncio.sleep(2.0)
        terminated.append(await asyncio.to_thread(cluster.drop_database_connections, block_s))

    async with _client(cluster) as client:
        tasks = [asyncio.create_task(worker(i, client)) for i in range(workers)]
        await faults()
        await asyncio.sleep(max(0.0, seconds - 8.0 - block_s))
        stop.set()
        await asyncio.gather(*tasks)
    return {
        "scenario": "drop the database connection",
        "fault": "pg_terminate_backend on all the gateway's backends twice, then again with "
        f"its database refusing connections for {block_s:g} s; {workers} clients sending",
        **tally.summary(),
        "backends_terminated": terminated,
        **recorded(cluster, tally),
        "lost_detail": tally.lost_detail(),
    }


# The request log is written behind the answers, and a write the database refused is retried
# up to 10 s later: how long the figure waits for the last outcomes.
RECORDED_WITHIN_S = 15.0


def recorded(cluster: Cluster, tally: Tally) -> dict[str, Any]:
    """How the gateway recorded the requests its clients saw complete (once its request log has
    caught up, or after RECORDED_WITHIN_S)."""
    ids = [r.request_id for r in tally.results if r.outcome == "completed" and r.request_id]
    if not ids:
        return {"completed_recorded_as": {}}
    deadline = time.monotonic() + RECORDED_WITHIN_S
    while True:
        rows = cluster.query(
            "SELECT status, count(*) FROM requests WHERE id = ANY(:ids) GROUP BY status", ids=ids
        )
        by_status = {str(status): int(str(n)) for status, n in rows}
        behind = sum(by_status.values()) < len(ids) or "dispatched" in by_status
        if not behind or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    missing = len(ids) - sum(by_status.values())
    if missing:
        by_status["no row"] = missing
    return {"completed_recorded_as": by_status}
