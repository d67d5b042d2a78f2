"""Issue 52: the batch plan's order changes when each item starts and where, never what it
answers. The same 50-item batch (a shared prefix behind some prompts, short and long answers) on
a federation per GATEWAY_BATCH_ORDER gives the same greedy answers, item for item."""

from __future__ import annotations

import httpx
import pytest

from devtools.launch import stop_all
from tests.e2e.batch_client import all_results, item, wait_for

pytestmark = pytest.mark.slow
SITES = ["aws-use1", "gcp-euw4"]
SHARED = "You are a careful assistant. Answer in one short paragraph. " * 4


def batch_items() -> list[dict[str, object]]:
    items = []
    for i in range(50):
        prompt = (SHARED if i % 3 else "") + f"Question {i}: describe the number {i * 7}."
        items.append(item(f"q{i}", prompt, 24 if i % 2 else 4))
    return items


@pytest.mark.timeout(600)
def test_every_order_gives_the_same_answers(start_federation) -> None:
    answers: dict[str, dict[str, str]] = {}
    for order in ("blend", "longest_first", "submission", "dfs"):
        federation = start_federation(
            live=SITES,
            env={"GATEWAY_BATCH_ORDER": order, "GATEWAY_BATCH_SITE_CONCURRENCY": "4"},
        )
        with httpx.Client(base_url=federation.base_url, timeout=60) as client:
            created = client.post("/v1/batches", json={"model": "tiny", "requests": batch_items()})
            assert created.status_code == 200, created.text
            done = wait_for(client, created.json()["id"], timeout_s=300)
            assert done["request_counts"] == {"total": 50, "completed": 50, "failed": 0}
            results = all_results(client, done["id"], 100)
        reasons = {r["assignment"]["reason"].split(":")[0] for r in results}
        assert reasons == ({"blend"} if order == "blend" else {"mico batch"})
        answers[order] = {r["custom_id"]: r["response"]["choices"][0]["text"] for r in results}
        # One federation at a time: the 2-core machine runs the next order's sites alone.
        stop_all([federation.gateway, *federation.sites.values()])
    assert len({tuple(sorted(a.items())) for a in answers.values()}) == 1
