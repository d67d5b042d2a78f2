"""Offload through the public API: a site that comes up idle takes the queued requests of a busy
one, the clients' streams finish normally, and every move is recorded."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from devtools.launch import spawn_site, start_gateway, wait_until_serving
from tests.e2e.conftest import Federation, write_federation

pytestmark = pytest.mark.slow
ANSWER = 400


def test_queued_requests_move_to_a_site_with_free_slots(tiny_llama_dir: Path, tmp_path) -> None:
    """Round robin (not token-aware) gives the one-slot site a queue while the four-slot site
    has room: offload moves the queued requests over, and the clients notice nothing."""
    busy = spawn_site(
        model_dir=tiny_llama_dir,
        site_name="aws-use1",
        model_name="tiny",
        log_dir=tmp_path,
        extra_args=["--max-num-seqs", "1"],
    )
    roomy = spawn_site(
        model_dir=tiny_llama_dir,
        site_name="gcp-euw4",
        model_name="tiny",
        log_dir=tmp_path,
        extra_args=["--max-num-seqs", "4"],
    )
    sites = [wait_until_serving(busy), wait_until_serving(roomy)]
    endpoints = {p.name: f"127.0.0.1:{p.port}" for p in sites}
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    gateway = start_gateway(
        federation_file=write_federation(tmp_path / "federation.json", tiny_llama_dir, endpoints),
        database_url=database_url,
        log_dir=tmp_path,
        expect_healthy_sites=2,
        env={"GATEWAY_OFFLOAD_INTERVAL_S": "0.2", "GATEWAY_LOAD_REPORT_INTERVAL_MS": "100"},
    )
    federation = Federation(gateway, {p.name: p for p in sites}, database_url)
    try:
        finishes: list[tuple[str, int]] = []

        def stream_one(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": f"request {i}",
                "max_tokens": ANSWER,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream(
                "POST", f"{federation.base_url}/v1/completions", json=body, timeout=300
            ) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            usage = httpx.Response(200, content=lines[-2][6:]).json()["usage"]
            finishes.append((lines[-1], usage["completion_tokens"]))

        clients = [threading.Thread(target=stream_one, args=(i,)) for i in range(6)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=300)
        assert sorted(finishes) == [("data: [DONE]", ANSWER)] * 6  # every stream whole
        moved = federation.query(
            "SELECT e.request_id, f.name, t.name FROM offload_events e "
            "JOIN sites f ON f.id = e.from_site_id JOIN sites t ON t.id = e.to_site_id "
            "ORDER BY e.id"
        )
        assert moved, "nothing was offloaded"
        # The one-slot site's queue goes to the roomy one; once the roomy one holds more than
        # its four slots, a queued request may come back to the one-slot site when it idles
        # (offload works in both directions): each move is recorded with the request.
        directions = [(giver, taker) for _, giver, taker in moved]
        assert directions[0] == ("aws-use1", "gcp-euw4")
        assert set(directions) <= {("aws-use1", "gcp-euw4"), ("gcp-euw4", "aws-use1")}
        for request_id in {request_id for request_id, _, _ in moved}:
            hops = [(g, t) for r, g, t in moved if r == request_id]
            (row,) = federation.rows(f"r.id = '{request_id}'")
            assert (row["site_name"], row["attempts"], row["status"]) == (
                hops[-1][1],
                len(hops) + 1,
                "completed",
            )
    finally:
        for process in (gateway, *sites):
            process.stop()
