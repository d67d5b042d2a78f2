"""Fault handling through the public API, with real site and gateway processes on loopback:
an answer whose site dies mid-stream continues on another site, Idempotency-Key retries get the
first result (also after a gateway restart), overload is refused at once with Retry-After, an
admin drain moves a site's queue elsewhere, and a client that leaves (or a request that times
out) frees its KV blocks at the site."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path

import httpx
import pytest

from devtools.launch import (
    ManagedProcess,
    readiness,
    spawn_site,
    start_gateway,
    wait_until_serving,
)
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView, SiteUnavailable
from tests.e2e.conftest import Federation, write_federation

pytestmark = pytest.mark.slow
ADMIN = "reliability-admin-token-0123456789"
# Long enough that a site is still generating when a test acts on it (~300 tokens/s on CPU).
LONG = 900
# The gateway must not notice a stopped or killed site by itself during a test: the paths
# under test (continuation, bounds) are what keeps requests alive or refuses them.
DEAF = {"GATEWAY_HEALTH_INTERVAL_S": "300", "GATEWAY_LOAD_REPORT_STALE_S": "300"}


def site_load(process: ManagedProcess) -> LoadView:
    """The site's own load report, read from it directly (a new connection can fail on a busy
    two-core machine: the probe tries a few times)."""

    async def one() -> LoadView:
        client = GrpcSiteClient(process.name, f"127.0.0.1:{process.port}", 5.0)
        try:
            async with aclosing(client.load_reports(50)) as reports:
                async for report in reports:
                    return report
        finally:
            await client.close()
        raise AssertionError("no load report")

    for _ in range(4):
        try:
            return asyncio.run(one())
        except SiteUnavailable:
            time.sleep(0.2)
    return asyncio.run(one())


def wait_for(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@contextmanager
def stopped(process: ManagedProcess) -> Iterator[None]:
    """SIGSTOP: the site holds every call it has and answers nothing until SIGCONT."""
    os.kill(process.popen.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.popen.pid, signal.SIGCONT)


def sse_payloads(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[6:]


def long_body() -> dict[str, object]:
    return {"model": "tiny", "prompt": "a long answer", "max_tokens": LONG, "ignore_eos": True}


# ---- a site dies mid-stream -------------------------------------------------------------------


def test_an_answer_whose_site_dies_mid_stream_continues_on_another_site(start_federation) -> None:
    federation = start_federation(live=["aws-use1", "gcp-euw4", "azure-jpe"], env=DEAF)
    url = f"{federation.base_url}/v1/completions"
    # Seeded sampling: the continuation must go on with the random stream where it stopped.
    body = {**long_body(), "max_tokens": 600, "temperature": 1.0, "seed": 7}
    reference = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]

    # Streaming: the site is stopped after the first token, then killed.
    texts, usage, ending = [], None, None
    with httpx.stream(
        "POST",
        url,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ) as response:
        first_site = response.headers["x-fedllm-site"]
        payloads = sse_payloads(response.iter_lines())
        for payload in payloads:
            event = json.loads(payload)
            assert "error" not in event, event
            texts.append(event["choices"][0]["text"])
            if event["choices"][0]["text"]:
                break
        # Stopped first, so that it produces nothing more between this line and the kill.
        os.kill(federation.sites[first_site].popen.pid, signal.SIGSTOP)
        federation.sites[first_site].kill()
        for payload in payloads:
            if payload == "[DONE]":
                ending = payload
                break
            event = json.loads(payload)
            assert "error" not in event, event
            if event["choices"]:
                texts.append(event["choices"][0]["text"])
            else:
                usage = event["usage"]
    assert ending == "[DONE]"
    assert "".join(texts) == reference  # one answer, as if nothing had happened
    assert usage is not None
    assert usage["completion_tokens"] == 600
    (row,) = federation.rows("r.stream = 1 AND r.status = 'completed'")
    assert row["attempts"] == 2
    (moved,) = json.loads(str(row["continuations"]))
    assert moved["from"] == first_site
    assert moved["to"] == row["site_name"] != first_site
    assert 0 < moved["after_tokens"] < 600

    # Not streaming: the site running the request is killed while the client waits.
    live = {name: p for name, p in federation.sites.items() if p.alive()}
    answer: dict[str, httpx.Response] = {}
    waiter = threading.Thread(
        target=lambda: answer.update(r=httpx.post(url, json=body, timeout=60))
    )
    waiter.start()
    busy: list[str] = []

    def some_site_runs_it() -> bool:
        busy[:] = [name for name, p in live.items() if site_load(p).running_requests > 0]
        return bool(busy)

    wait_for(some_site_runs_it)
    live[busy[0]].kill()
    waiter.join(timeout=60)
    response = answer["r"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference
    assert response.json()["usage"]["completion_tokens"] == 600
    (row,) = federation.rows("r.stream = 0 AND r.continuations IS NOT NULL")
    assert row["status"] == "completed"
    assert json.loads(str(row["continuations"]))[0]["from"] == busy[0]


def test_requests_queued_at_a_site_that_dies_are_served_elsewhere(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A site that accepted requests but had not started them (its batch was full) dies: they
    had produced nothing, so they go to another site; the one it was running continues there."""
    victim = spawn_site(model_dir=tiny_llama_dir, site_name="aws-use1", model_name="tiny",
                        log_dir=tmp_path, extra_args=["--max-num-seqs", "1"])  # fmt: skip
    other = spawn_site(model_dir=tiny_llama_dir, site_name="gcp-euw4", model_name="tiny",
                       log_dir=tmp_path)  # fmt: skip
    processes = [victim, other]
    try:
        for process in processes:
            wait_until_serving(process)
        endpoints = {p.name: f"127.0.0.1:{p.port}" for p in processes}
        gateway = start_gateway(
            federation_file=write_federation(tmp_path / "f.json", tiny_llama_dir, endpoints),
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
            log_dir=tmp_path,
            expect_healthy_sites=2,
            env=DEAF,  # round robin (the default): every other request goes to the victim
        )
        processes.append(gateway)
        url = f"http://127.0.0.1:{gateway.port}/v1/completions"
        body = {**long_body(), "max_tokens": 300}
        answers: list[httpx.Response] = []
        senders = [
            threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=90)))
            for _ in range(4)
        ]
        for sender in senders:
            sender.start()
        wait_for(lambda: site_load(victim).queued_requests >= 1)
        victim.kill()
        for sender in senders:
            sender.join(timeout=90)
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert all(a.json()["usage"]["completion_tokens"] == 300 for a in answers)
        assert {a.headers["x-fedllm-site"] for a in answers} <= {"aws-use1", "gcp-euw4"}
    finally:
        for process in reversed(processes):
            process.stop()


# ---- Idempotency-Key --------------------------------------------------------------------------


def test_a_retry_with_an_idempotency_key_gets_the_first_result(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    site = wait_until_serving(
        spawn_site(
            model_dir=tiny_llama_dir, site_name="aws-use1", model_name="tiny", log_dir=tmp_path
        )
    )
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    federation_file = write_federation(
        tmp_path / "federation.json", tiny_llama_dir, {"aws-use1": f"127.0.0.1:{site.port}"}
    )

    def gateway() -> ManagedProcess:
        return start_gateway(
            federation_file=federation_file, database_url=database_url, log_dir=tmp_path, env=DEAF
        )

    first_gateway = gateway()
    federation = Federation(first_gateway, {"aws-use1": site}, database_url)
    # Unseeded sampling: a second run would give another answer.
    body = {"model": "tiny", "prompt": "once", "max_tokens": 12, "temperature": 1.0}
    key = {"Idempotency-Key": "order-42"}
    try:
        with httpx.Client(base_url=federation.base_url, timeout=60) as client:
            first = client.post("/v1/completions", json=body, headers=key)
            assert first.status_code == 200
            again = client.post("/v1/completions", json=body, headers=key)
            assert (again.status_code, again.json()) == (200, first.json())
            assert again.headers["idempotent-replayed"] == "true"
            assert len(federation.rows()) == 1  # ran once

            other = client.post("/v1/completions", json={**body, "max_tokens": 3}, headers=key)
            assert other.status_code == 422
            assert other.json()["error"]["code"] == "idempotency_key_reused"
            chat = client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                headers=key,
            )
            assert chat.status_code == 422  # a key names one request, on one endpoint
            streamed = client.post("/v1/completions", json={**body, "stream": True}, headers=key)
            assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "stream")
            too_long = client.post(
                "/v1/completions", json=body, headers={"Idempotency-Key": "k" * 256}
            )
            assert too_long.status_code == 400

            # While the first request with a key runs, a retry is told to come back later.
            slow = {"Idempotency-Key": "slow-1"}
            answer: dict[str, httpx.Response] = {}
            with stopped(site):
                waiter = threading.Thread(
                    target=lambda: answer.update(
                        r=httpx.post(
                            f"{federation.base_url}/v1/completions",
                            json=body,
                            headers=slow,
                            timeout=60,
                        )
                    )
                )
                waiter.start()
                wait_for(lambda: len(federation.rows()) == 2)  # the first one is dispatched
                busy = client.post("/v1/completions", json=body, headers=slow)
                assert busy.status_code == 409
                assert busy.json()["error"]["code"] == "idempotency_key_in_use"
                assert busy.headers["retry-after"]
            waiter.join(timeout=60)
            assert answer["r"].status_code == 200
            replay = client.post("/v1/completions", json=body, headers=slow)
            assert replay.json() == answer["r"].json()

        # The records are in the database: a restarted gateway answers the retry the same way.
        first_gateway.stop()
        federation.gateway = gateway()
        after_restart = httpx.post(
            f"{federation.base_url}/v1/completions", json=body, headers=key, timeout=60
        )
        assert (after_restart.status_code, after_restart.json()) == (200, first.json())
        assert len(federation.rows()) == 2
    finally:
        federation.gateway.stop()
        first_gateway.stop()
        site.stop()


# ---- overload ---------------------------------------------------------------------------------


def test_overload_is_refused_at_once_with_retry_after(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A full gateway answers 429, a site whose queue is at its bound is left out (503 when no
    site is left); both at once, with Retry-After, while the accepted requests complete."""
    site = wait_until_serving(
        spawn_site(
            model_dir=tiny_llama_dir,
            site_name="aws-use1",
            model_name="tiny",
            log_dir=tmp_path,
            extra_args=["--max-num-seqs", "1"],
        )
    )
    endpoints = {"aws-use1": f"127.0.0.1:{site.port}"}
    federation_file = write_federation(tmp_path / "federation.json", tiny_llama_dir, endpoints)
    gateways = [
        start_gateway(
            federation_file=federation_file,
            database_url=f"sqlite+aiosqlite:///{tmp_path / f'gateway-{i}.db'}",
            log_dir=tmp_path / f"g{i}",
            env={**DEAF, **env},
        )
        for i, env in enumerate(
            [
                {"GATEWAY_MAX_IN_FLIGHT": "1"},
                {"GATEWAY_MAX_IN_FLIGHT": "10", "GATEWAY_SITE_MAX_QUEUED_REQUESTS": "1"},
            ]
        )
    ]
    body = {"model": "tiny", "prompt": "busy", "max_tokens": 8}
    answers: list[httpx.Response] = []

    def post(port: int) -> None:
        answers.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60))

    try:
        with stopped(site):  # nothing finishes while the site is stopped
            held = [threading.Thread(target=post, args=(gateways[0].port,))]
            # One running (the site's only slot) and one queued: the site's queue bound.
            held += [threading.Thread(target=post, args=(gateways[1].port,)) for _ in range(2)]
            for thread in held:
                thread.start()
                time.sleep(0.3)  # dispatched in this order
            for gateway, status, code in (
                (gateways[0], 429, "gateway_overloaded"),
                (gateways[1], 503, "service_unavailable"),
            ):
                started = time.monotonic()
                refused = httpx.post(
                    f"http://127.0.0.1:{gateway.port}/v1/completions", json=body, timeout=30
                )
                assert time.monotonic() - started < 2
                assert refused.status_code == status, refused.text
                assert refused.json()["error"]["code"] == code
                assert int(refused.headers["retry-after"]) >= 1
        for thread in held:
            thread.join(timeout=60)
        assert [r.status_code for r in answers] == [200] * 3  # the accepted ones completed
    finally:
        for gateway in gateways:
            gateway.stop()
        site.stop()


# ---- drain ------------------------------------------------------------------------------------


def test_a_drained_site_hands_its_queue_over_and_finishes_what_runs(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    sites = {
        name: spawn_site(
            model_dir=tiny_llama_dir,
            site_name=name,
            model_name="tiny",
            log_dir=tmp_path,
            extra_args=["--max-num-seqs", "1"],
        )
        for name in ("aws-use1", "gcp-euw4")
    }
    for process in sites.values():
        wait_until_serving(process)
    endpoints = {name: f"127.0.0.1:{p.port}" for name, p in sites.items()}
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    gateway = start_gateway(
        federation_file=write_federation(tmp_path / "federation.json", tiny_llama_dir, endpoints),
        database_url=database_url,
        log_dir=tmp_path,
        expect_healthy_sites=2,
        env={
            "GATEWAY_ADMIN_TOKEN": ADMIN,
            "GATEWAY_OFFLOAD_ENABLED": "false",  # only the drain moves work here
            "GATEWAY_LOAD_REPORT_INTERVAL_MS": "50",
        },
    )
    federation = Federation(gateway, sites, database_url)
    admin = httpx.Client(
        base_url=federation.base_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
    )
    finishes: list[tuple[str, int]] = []

    def stream_one() -> None:
        with httpx.stream(
            "POST",
            f"{federation.base_url}/v1/completions",
            json={**long_body(), "stream": True, "stream_options": {"include_usage": True}},
            timeout=120,
        ) as response:
            payloads = list(sse_payloads(response.iter_lines()))
        finishes.append((payloads[-1], json.loads(payloads[-2])["usage"]["completion_tokens"]))

    try:
        assert (
            httpx.post(f"{federation.base_url}/admin/api/sites/gcp-euw4/drain").status_code == 401
        )
        assert admin.post("/admin/api/sites/nowhere/drain").status_code == 404
        # Everything goes to aws-use1 while gcp-euw4 drains: one runs there, two queue.
        assert admin.post("/admin/api/sites/gcp-euw4/drain").json()["draining"] is True
        clients = [threading.Thread(target=stream_one) for _ in range(3)]
        for client in clients:
            client.start()
        wait_for(lambda: site_load(sites["aws-use1"]).queued_requests == 2)
        assert admin.post("/admin/api/sites/gcp-euw4/undrain").json()["draining"] is False
        drained = admin.post("/admin/api/sites/aws-use1/drain").json()
        assert (drained["draining"], drained["released"]) == (True, 2)
        assert readiness(federation.gateway)["draining"] == ["aws-use1"]
        overview = admin.get("/admin/api/overview").json()
        assert {s["name"]: s["draining"] for s in overview["sites"]} == {
            "aws-use1": True,
            "gcp-euw4": False,
        }
        # New work avoids the draining site.
        new = httpx.post(
            f"{federation.base_url}/v1/completions",
            json={"model": "tiny", "prompt": "new", "max_tokens": 2},
            timeout=60,
        )
        assert new.headers["x-fedllm-site"] == "gcp-euw4"
        for client in clients:
            client.join(timeout=120)
        assert sorted(finishes) == [("[DONE]", LONG)] * 3  # every stream whole
        moved = federation.query(
            "SELECT f.name, t.name FROM offload_events e "
            "JOIN sites f ON f.id = e.from_site_id JOIN sites t ON t.id = e.to_site_id"
        )
        assert moved == [("aws-use1", "gcp-euw4")] * 2
        ran = federation.rows("r.max_tokens = 900")
        assert sorted(str(r["site_name"]) for r in ran) == ["aws-use1", "gcp-euw4", "gcp-euw4"]
    finally:
        admin.close()
        gateway.stop()
        for process in sites.values():
            process.stop()


# ---- deadlines and cancellation ---------------------------------------------------------------


def test_a_client_that_leaves_frees_its_kv_blocks(start_federation) -> None:
    federation = start_federation(live=["aws-use1"])
    site = federation.sites["aws-use1"]
    url = f"{federation.base_url}/v1/completions"
    assert site_load(site).kv_blocks_used == 0
    with httpx.stream("POST", url, json={**long_body(), "stream": True}, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        during = site_load(site)
        assert (during.running_requests, during.kv_blocks_used > 0) == (1, True)
    # The client went away mid-answer: the site cancels the request and frees its blocks.
    wait_for(lambda: site_load(site).kv_blocks_used == 0, timeout_s=5)
    assert site_load(site).running_requests == 0
    wait_for(lambda: bool(federation.rows("r.status = 'cancelled'")))
    (cancelled,) = federation.rows("r.status = 'cancelled'")
    assert cancelled["error"] == "client went away"
    assert cancelled["completion_tokens"] < LONG


def test_a_request_past_its_timeout_ends_with_504_and_frees_its_blocks(start_federation) -> None:
    federation = start_federation(live=["gcp-euw4"], env={"GATEWAY_REQUEST_TIMEOUT_S": "1"})
    site = federation.sites["gcp-euw4"]
    # An answer that takes about 3 s against a 1 s timeout: a clear 504, and the site (which
    # saw the same deadline) cancels the request and frees its blocks.
    started = time.monotonic()
    timed_out = httpx.post(
        f"{federation.base_url}/v1/completions",
        json={**long_body(), "max_tokens": 1000},
        timeout=60,
    )
    assert time.monotonic() - started < 3
    assert timed_out.status_code == 504
    error = timed_out.json()["error"]
    assert error["code"] == "request_timeout"
    assert "GATEWAY_REQUEST_TIMEOUT_S" in error["message"]
    wait_for(lambda: site_load(site).kv_blocks_used == 0, timeout_s=5)
    assert site_load(site).running_requests == 0
    (failed,) = federation.rows("r.status = 'failed'")
    assert failed["completion_tokens"] < 1000
