"""Issue 52, end to end: a `service_tier: "flex"` chat request waits behind interactive ones and
is never lost. One site with a single batch slot (SITE_MAX_NUM_SEQS=1), so that the order the
engine admits in is the order answers end in: while a long interactive answer holds the slot, a
flex request arrives, then two interactive ones; the interactive ones are served first, and the
flex one afterwards, complete.

The order is read from each request's first token as the gateway recorded it (`first_token_at`),
not from when the client's threads woke up: with one slot, a request's first token comes only
after the one before it ended, so those times are a whole answer apart, while the client's
threads, on a loaded machine, can see two answers that ended a few steps apart in either order."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import bindparam, create_engine, text

from devtools.launch import spawn_site, start_gateway, stop_all, wait_until_serving
from gateway.db.migrate import sync_url
from tests.e2e.conftest import wait_until_written, write_federation

pytestmark = pytest.mark.slow
LONG, SHORT = 900, 12  # the tiny model's context: 1,024
ADMIN = "flex-priority-admin-token"  # /metrics asks for it


def chat(client: httpx.Client, tier: str, tokens: int, done: dict[str, Any], key: str) -> None:
    done[key] = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Request {key}: count to ten."}],
            "temperature": 0,
            "max_completion_tokens": tokens,
            "ignore_eos": True,
            "service_tier": tier,
        },
    )


def wait_in_flight(client: httpx.Client, count: int, timeout_s: float = 60) -> None:
    """Until the gateway holds `count` unfinished requests at its site (its metrics)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        lines = metrics.text.splitlines()
        gauge = [
            line for line in lines if line.startswith("fedllm_gateway_site_in_flight_requests{")
        ]
        if gauge and float(gauge[0].rsplit(" ", 1)[1]) >= count:
            return
        assert time.monotonic() < deadline, f"{count} requests never in flight at once: {gauge}"
        time.sleep(0.01)


def first_tokens(database: Path, ids: dict[str, str]) -> dict[str, datetime]:
    """When each request's first token reached the gateway, by the test's key."""
    engine = create_engine(sync_url(f"sqlite+aiosqlite:///{database}"))
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT id, first_token_at FROM requests WHERE id IN :ids").bindparams(
                    bindparam("ids", expanding=True)
                ),
                {"ids": list(ids.values())},
            ).all()
    finally:
        engine.dispose()
    by_id = {row[0]: row[1] for row in rows}
    return {key: _as_datetime(by_id[request_id]) for key, request_id in ids.items()}


def _as_datetime(value: object) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(str(value))


@pytest.mark.timeout(300)
def test_a_flex_request_waits_behind_interactive_ones_and_is_answered(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    site = spawn_site(
        model_dir=tiny_llama_dir,
        site_name="aws-use1",
        model_name="tiny",
        log_dir=tmp_path,
        env={"SITE_MAX_NUM_SEQS": "1"},
    )
    processes = [site]
    try:
        wait_until_serving(site)
        gateway = start_gateway(
            federation_file=write_federation(
                tmp_path / "federation.json", tiny_llama_dir, {"aws-use1": f"127.0.0.1:{site.port}"}
            ),
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
            log_dir=tmp_path,
            env={"GATEWAY_ADMIN_TOKEN": ADMIN},
        )
        processes.append(gateway)
        done: dict[str, Any] = {}
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=240) as client:
            plan = [("hold", "default", LONG), ("flex", "flex", SHORT),
                    ("chat1", "default", SHORT), ("chat2", "auto", SHORT)]  # fmt: skip
            threads = []
            for sent, (key, tier, tokens) in enumerate(plan, start=1):
                thread = threading.Thread(target=chat, args=(client, tier, tokens, done, key))
                thread.start()
                threads.append(thread)
                # Each at the site before the next is sent, all while `hold` still runs (a
                # fixed 0.3 s apart, a fast machine ended `hold`'s 600 tokens before the last
                # was sent, and served `flex` before it).
                wait_in_flight(client, sent)
            for thread in threads:
                thread.join(timeout=240)
        assert set(done) == {key for key, _, _ in plan}
        for key, _, tokens in plan:
            response = done[key]
            assert response.status_code == 200, (key, response.text)
            assert response.json()["usage"]["completion_tokens"] == tokens, key
        wait_until_written(f"http://127.0.0.1:{gateway.port}")
        first = first_tokens(tmp_path / "gateway.db", {k: done[k].json()["id"] for k in done})
        assert first["hold"] < min(first["chat1"], first["chat2"])
        # Sent before both interactive requests, served after them.
        assert first["flex"] > max(first["chat1"], first["chat2"])
    finally:
        stop_all(processes)
