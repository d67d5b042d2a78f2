"""A gateway dies with a batch half done; a new gateway on the same PostgreSQL database finishes
it, re-running only the items that were in flight: every item is recorded exactly once. Both
forms of a batch: made from an uploaded file (OpenAI's) and inline."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.launch import start_gateway
from tests.e2e.batch_client import all_results, item, wait_for
from tests.e2e.conftest import wait_until_written, write_federation

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
ITEMS, TOKENS = 16, 200
# One item per site at a time, so the batch takes long enough to be caught half done; a short
# lease, so the new gateway takes over soon after the old one's lapses.
ENV = {"GATEWAY_BATCH_SITE_CONCURRENCY": "1", "GATEWAY_BATCH_LEASE_S": "2"}


def items_by_custom_id(federation, batch_id: str) -> dict[str, tuple[str, str, int]]:
    rows = federation.query(
        "SELECT custom_id, status, request_id, attempts FROM batch_items "
        f"WHERE batch_id = '{batch_id}'"
    )
    return {str(cid): (str(status), str(rid), int(n)) for cid, status, rid, n in rows}


def submit(client: httpx.Client, form: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    if form == "inline":
        created = client.post("/v1/batches", json={"model": "tiny", "requests": items})
    else:
        lines = [
            {
                "custom_id": body.pop("custom_id"),
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "tiny", **body},
            }
            for body in (dict(i) for i in items)
        ]
        content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        uploaded = client.post(
            "/v1/files", files={"file": ("batch.jsonl", content)}, data={"purpose": "batch"}
        )
        assert uploaded.status_code == 200, uploaded.text
        created = client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        )
    assert created.status_code == 200, created.text
    batch: dict[str, Any] = created.json()
    return batch


@pytest.mark.parametrize("form", ["file", "inline"])
def test_new_gateway_resumes_a_batch_exactly_once(
    start_federation, postgres_url: str, tiny_llama_dir: Path, tmp_path: Path, form: str
) -> None:
    from gateway.db.migrate import downgrade

    federation = start_federation(live=["aws-use1", "gcp-euw4"], database_url=postgres_url, env=ENV)
    successor = None
    try:
        items = [item(f"r{i}", f"Story number {i}", TOKENS) for i in range(ITEMS)]
        with httpx.Client(base_url=federation.base_url, timeout=60) as client:
            batch = submit(client, form, items)
            deadline = time.monotonic() + 120
            while True:
                statuses = [r["status"] for r in all_results(client, batch["id"], 100)]
                if statuses.count("completed") >= 4 and "running" in statuses:
                    break
                assert time.monotonic() < deadline, statuses
                time.sleep(0.05)
        federation.gateway.kill()  # no shutdown: leases, streams and rows left as they were

        before = items_by_custom_id(federation, batch["id"])
        done_before = {cid for cid, (status, *_) in before.items() if status == "completed"}
        in_flight = {cid for cid, (status, *_) in before.items() if status == "running"}
        assert 4 <= len(done_before) < ITEMS
        assert in_flight

        endpoints = {name: f"127.0.0.1:{p.port}" for name, p in federation.sites.items()}
        successor = start_gateway(
            federation_file=write_federation(tmp_path / "fed.json", tiny_llama_dir, endpoints),
            database_url=postgres_url,
            log_dir=tmp_path,
            expect_healthy_sites=2,
            env=ENV,
        )
        with httpx.Client(base_url=f"http://127.0.0.1:{successor.port}", timeout=60) as client:
            done = wait_for(client, batch["id"])
            results = all_results(client, batch["id"], 100)
            output = client.get(f"/v1/files/{done['output_file_id']}/content")
        assert done["status"] == "completed"
        # The output file, written once by the gateway that finished the batch: one line each.
        assert output.status_code == 200, output.text
        lines = [json.loads(line) for line in output.text.splitlines()]
        assert [line["custom_id"] for line in lines] == [i["custom_id"] for i in items]
        assert done["request_counts"] == {"total": ITEMS, "completed": ITEMS, "failed": 0}
        assert [r["custom_id"] for r in results] == [i["custom_id"] for i in items]
        assert all(r["response"]["usage"]["completion_tokens"] == TOKENS for r in results)

        # The rows below are the successor's to write (federation.query waits on the killed
        # gateway, which writes nothing more): wait until its request log has written them.
        wait_until_written(f"http://127.0.0.1:{successor.port}")
        after = items_by_custom_id(federation, batch["id"])
        for cid in done_before:  # recorded complete: never started again
            assert after[cid] == before[cid]
        for cid in in_flight:  # interrupted: run again, once more
            assert after[cid][2] == before[cid][2] + 1

        # An item that was not in flight ran once. One that was has a second row unless the
        # kill came before it reached a site, and that row may even say completed: the site
        # finished it just before the kill, but the batch had not recorded it. An item the
        # killed gateway completed has its one row, but the row's outcome may still say
        # dispatched: the request log is written behind the answers, and a crash loses its
        # last flush interval (docs/reliability.md); the item's own record is complete.
        runs: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for row in federation.rows("r.api = 'batch'"):
            detail = row["routing_detail"]
            detail = json.loads(detail) if isinstance(detail, str) else detail
            runs[detail["custom_id"]].append((str(row["id"]), str(row["status"])))
        outcome_lost = []
        for cid, (_, request_id, _) in after.items():
            completed = [rid for rid, status in runs[cid] if status == "completed"]
            if cid in in_flight:
                assert request_id in completed, (cid, runs[cid])
                assert len(runs[cid]) in (1, 2), (cid, runs[cid])
            elif cid in done_before and runs[cid] == [(request_id, "dispatched")]:
                outcome_lost.append(cid)
            else:
                assert runs[cid] == [(request_id, "completed")], (cid, runs[cid])
        # One item per site at a time, ~200 tokens each: at most one finish per site fits in
        # the moments before the kill.
        assert len(outcome_lost) <= 2, outcome_lost
    finally:
        if successor is not None:
            successor.stop()
        federation.gateway.stop()
        downgrade(postgres_url)
