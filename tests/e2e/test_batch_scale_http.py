"""A large batch through a real gateway on PostgreSQL (issue 58: "a 90,000-item batch takes 117
s to create, and cancelling it stalls the gateway ~1 s"): while a 20,000-item chat batch is
created from its file and then cancelled, another client's `/healthz` keeps being answered;
the batch ends `cancelled` with every item in its error file.

The bound on `/healthz` is generous (CI runs two workers on two cores): it catches a loop held
for whole seconds, as the issue saw; the loop's own CPU per stretch is bounded tighter in
tests/integration/test_batch_scale.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.db.migrate import downgrade
from tests.e2e.conftest import Federation
from tests.security.healthz_probe import probing_healthz

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
ITEMS = 20_000
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def federation(start_federation, postgres_url: str) -> Iterator[Federation]:
    started: Federation = start_federation(live=["aws-use1"], database_url=postgres_url)
    try:
        yield started
    finally:
        started.gateway.stop()
        downgrade(postgres_url)


def batch_file(count: int) -> bytes:
    def line(i: int) -> str:
        messages = [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"Item {i}: say hello"},
        ]
        body = {"model": "tiny", "messages": messages, "max_tokens": 2}
        return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": body})

    return "".join(line(i) + "\n" for i in range(count)).encode()


def test_a_large_batch_is_created_and_cancelled_while_health_checks_are_answered(
    federation: Federation,
) -> None:
    gateway_pid = federation.gateway.popen.pid
    with httpx.Client(base_url=federation.base_url, timeout=300) as client:
        upload = client.post(
            "/v1/files", files={"file": ("big.jsonl", batch_file(ITEMS))}, data={"purpose": "batch"}
        )
        assert upload.status_code == 200, upload.text[:300]
        client.get("/healthz")
        probe_creating = probing_healthz(federation.base_url, every_s=0.02, server_pid=gateway_pid)
        with probe_creating as creating:
            created = client.post(
                "/v1/batches",
                json={
                    "input_file_id": upload.json()["id"],
                    "endpoint": CHAT,
                    "completion_window": "24h",
                },
            )
        assert created.status_code == 200, created.text[:300]
        batch_id = created.json()["id"]
        assert created.json()["request_counts"]["total"] == ITEMS
        probe_cancel = probing_healthz(federation.base_url, every_s=0.02, server_pid=gateway_pid)
        with probe_cancel as cancelling:
            cancel = client.post(f"/v1/batches/{batch_id}/cancel")
            assert cancel.status_code == 200, cancel.text[:300]
            assert cancel.json()["status"] in ("cancelling", "cancelled")
            deadline = time.monotonic() + 120
            while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] != "cancelled":
                assert time.monotonic() < deadline, batch
                time.sleep(0.1)
        counts = batch["request_counts"]
        assert counts["total"] == ITEMS
        errors = client.get(f"/v1/files/{batch['error_file_id']}/content").content.splitlines()
        # Items answered before the cancel keep their answers (OpenAI's cancel); the others are
        # each a line of the error file.
        assert len(errors) == ITEMS - counts["completed"]
        stopped = [json.loads(line)["error"] for line in errors]
        assert sum(1 for e in stopped if e and e["code"] == "batch_cancelled") > ITEMS // 2
    for label, probe in (("created", creating), ("cancelled", cancelling)):
        assert probe.answers >= 3, (label, probe)
        assert probe.worst_s < 0.5, f"/healthz took {probe.worst_s:.2f} s while it was {label}"
