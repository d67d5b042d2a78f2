"""The batch API end to end: HTTP -> gateway (validation, prediction, MICO assignment, runner)
-> gRPC -> real site engines, and back through the results."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import httpx
import pytest

from predictor.baseline import SklearnConfig
from predictor.training import TrainingSet, TrainSpec, train_artifact
from tests.e2e.batch_client import all_results, item, wait_for
from tests.e2e.conftest import Federation
from tests.unit.predictor.conftest import synthetic_records

pytestmark = pytest.mark.slow
SITES = {"aws-use1", "gcp-euw4"}
MAX_ITEMS = 40
BATCH_BODY_LIMIT = 3_000_000


@pytest.fixture(scope="module")
def federation(start_federation, tmp_path_factory: pytest.TempPathFactory) -> Federation:
    artifact = tmp_path_factory.mktemp("predictor") / "base"
    data = TrainingSet(synthetic_records(120, seed=1), synthetic_records(40, seed=2, corpus="v"))
    spec = TrainSpec("sklearn", "log_n10_l1024", sklearn=SklearnConfig(max_iter=200))
    train_artifact(spec, data, artifact, progress=lambda _: None)
    return start_federation(
        live=sorted(SITES),
        env={
            "GATEWAY_PREDICTOR_DIR": str(artifact),
            "GATEWAY_BATCH_SITE_CONCURRENCY": "2",
            "GATEWAY_BATCH_MAX_ITEMS": str(MAX_ITEMS),
            "GATEWAY_BATCH_MAX_BODY_BYTES": str(BATCH_BODY_LIMIT),
        },
    )


@pytest.fixture
def client(federation: Federation):
    with httpx.Client(base_url=federation.base_url, timeout=60) as client:
        yield client


def post_batch(
    client: httpx.Client, body: Mapping[str, object], padding: int = 0
) -> httpx.Response:
    """JSON allows whitespace: padding makes a body large without changing what it says."""
    raw = json.dumps(body).encode() + b" " * padding
    return client.post("/v1/batches", content=raw, headers={"content-type": "application/json"})


def test_batch_completes_with_every_answer_as_asked(client, federation: Federation) -> None:
    token_prompt = [15496, 995]  # GPT-2 ids of "Hello world"
    items = [
        item(f"job-{i}", token_prompt if i == 5 else f"Write about topic {i}", 3 + 4 * i)
        for i in range(12)
    ]
    body = {"model": "tiny", "requests": items, "metadata": {"owner": "e2e"}}
    # Larger than /v1/completions' 1 MiB limit: batches have their own.
    created = post_batch(client, body, padding=1_200_000)
    assert created.status_code == 200, created.text
    batch = created.json()
    assert batch["id"].startswith("batch_")
    assert (batch["object"], batch["status"], batch["metadata"]) == (
        "batch",
        "validating",
        {"owner": "e2e"},
    )
    assert batch["request_counts"] == {"total": 12, "completed": 0, "failed": 0}

    done = wait_for(client, batch["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert done["created_at"] <= done["in_progress_at"] <= done["completed_at"]
    # The extension: progress by planned tokens, all of it finished.
    progress = done["progress"]
    assert progress["planned_tokens"] == progress["finished_tokens"] > 0
    assert (progress["fraction"], progress["eta_seconds"]) == (1.0, None)

    results = all_results(client, batch["id"])
    assert [r["custom_id"] for r in results] == [i["custom_id"] for i in items]
    for result, asked in zip(results, items, strict=True):
        assert (result["status"], result["error"]) == ("completed", None)
        completion = result["response"]
        assert completion["object"] == "text_completion"
        assert completion["choices"][0]["finish_reason"] == "length"
        assert completion["usage"]["completion_tokens"] == asked["max_tokens"]
        assignment = result["assignment"]
        assert assignment["site"] in SITES
        assert 1 <= assignment["predicted_tokens"] <= asked["max_tokens"]
        # The default order (GATEWAY_BATCH_ORDER=blend) gives each site a range of the
        # batch's resource-aware prefix tree.
        assert assignment["reason"].startswith("blend: range ")
    assert {r["assignment"]["site"] for r in results} == SITES
    assert results[5]["response"]["usage"]["prompt_tokens"] == 2

    # Same answer as the online API gives (greedy; every site has the same weights).
    single = {k: v for k, v in items[3].items() if k != "custom_id"}
    online = client.post("/v1/completions", json={"model": "tiny", **single})
    assert online.status_code == 200, online.text
    assert online.json()["choices"][0]["text"] == results[3]["response"]["choices"][0]["text"]

    rows = federation.rows("r.api = 'batch'")
    assert {row["id"] for row in rows} == {r["response"]["id"] for r in results}
    assert {(row["status"], row["routing_policy"]) for row in rows} == {("completed", "mico_batch")}
    assert all(row["predicted_tokens"] is not None for row in rows)

    listed = client.get("/v1/batches", params={"limit": 100}).json()
    assert batch["id"] in [b["id"] for b in listed["data"]]


def counts(federation: Federation) -> tuple[object, ...]:
    (row,) = federation.query(
        "SELECT (SELECT count(*) FROM batches), (SELECT count(*) FROM batch_items)"
    )
    return row


def test_items_their_endpoint_refuses_are_failed_items_of_an_accepted_batch(
    client, federation: Federation
) -> None:
    """A bad item (max_tokens 0, a prompt too long for the context) is failed with its
    endpoint's error; the batch is accepted and runs the others (OpenAI's way)."""
    body = {"model": "tiny", "requests": [
        item("a", "x", 2), item("c", "z", 0), item("d", "word " * 600, 500)]}  # fmt: skip
    response = post_batch(client, body, 0)
    assert response.status_code == 200, response.text
    created = response.json()
    assert created["request_counts"] == {"total": 3, "completed": 0, "failed": 2}
    (row,) = federation.query(
        f"SELECT count(*) FROM batch_items WHERE batch_id = '{created['id']}' "
        "AND status = 'failed' AND status_code = 400"
    )
    assert row == (2,)


@pytest.mark.parametrize(
    ("body", "padding", "status", "param", "message"),
    [
        (
            {"model": "tiny", "requests": [item(str(i), "x", 1) for i in range(MAX_ITEMS + 1)]},
            0,
            400,
            "requests",
            f"takes at most {MAX_ITEMS} per batch",
        ),
        ({"model": "tiny", "requests": []}, 0, 400, "requests", "at least one request"),
        ({"model": "nope", "requests": [item("a", "x", 1)]}, 0, 404, "model", "does not exist"),
        (
            {"model": "tiny", "requests": [item("a", "x", 1)]},
            BATCH_BODY_LIMIT,
            413,
            None,
            f"larger than {BATCH_BODY_LIMIT} bytes",
        ),
    ],
    ids=["too many", "empty", "unknown model", "body too large"],
)
def test_bad_batches_change_nothing(
    client, federation: Federation, body, padding, status, param, message
) -> None:
    before = counts(federation)
    response = post_batch(client, body, padding)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]
    assert counts(federation) == before


def test_cancel_stops_queued_and_running_items(client, federation: Federation) -> None:
    items = [item(f"long-{i}", f"Tell a long story {i}", 400) for i in range(16)]
    batch = post_batch(client, {"model": "tiny", "requests": items}).json()
    # An item is marked running before its dispatch records its request: wait for one whose
    # request is recorded, so that the cancel below stops an answer under way (an item
    # cancelled between the two has no request row, rightly: nothing was sent or billed).
    dispatched_sql = (
        "SELECT count(*) FROM batch_items i JOIN requests r ON r.id = i.request_id "
        f"WHERE i.batch_id = '{batch['id']}' AND i.status = 'running'"
    )
    deadline = time.monotonic() + 60
    while not federation.query(dispatched_sql)[0][0]:
        assert time.monotonic() < deadline
        time.sleep(0.1)

    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] in ("cancelling", "cancelled")
    done = wait_for(client, batch["id"], timeout_s=60)
    assert done["status"] == "cancelled"
    assert done["cancelling_at"] is not None
    assert done["cancelled_at"] is not None

    results = all_results(client, batch["id"], 100)
    statuses = [r["status"] for r in results]
    assert set(statuses) <= {"completed", "cancelled"}
    assert done["request_counts"] == {
        "total": 16,
        "completed": statuses.count("completed"),
        "failed": 0,
    }
    assert statuses.count("cancelled") >= 8  # 4 run at a time; 400 tokens each
    # Items cancelled while running were stopped at their sites, and recorded so (the request
    # log writes a cancellation in the background: give it a moment).
    stopped_sql = (
        "SELECT r.status FROM batch_items i JOIN requests r ON r.id = i.request_id "
        f"WHERE i.batch_id = '{batch['id']}' AND i.status = 'cancelled'"
    )
    deadline = time.monotonic() + 10
    while {s for (s,) in federation.query(stopped_sql)} != {"cancelled"}:
        assert time.monotonic() < deadline, federation.query(stopped_sql)
        time.sleep(0.1)
    assert {r["error"]["code"] for r in results if r["status"] == "cancelled"} == {
        "batch_cancelled"
    }

    again = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert (again.status_code, again.json()["status"]) == (200, "cancelled")


def test_finished_and_unknown_batches(client) -> None:
    batch = post_batch(client, {"model": "tiny", "requests": [item("one", "hi", 2)]}).json()
    assert wait_for(client, batch["id"])["status"] == "completed"
    refused = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "batch_not_cancellable"

    for method, path in [
        ("GET", "/v1/batches/batch_nope"),
        ("POST", "/v1/batches/batch_nope/cancel"),
        ("GET", "/v1/batches/batch_nope/results"),
    ]:
        response = client.request(method, path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "batch_not_found"
    bad_cursor = client.get("/v1/batches", params={"after": "batch_nope"})
    assert (bad_cursor.status_code, bad_cursor.json()["error"]["param"]) == (400, "after")
    bad_limit = client.get(f"/v1/batches/{batch['id']}/results", params={"limit": 0})
    assert (bad_limit.status_code, bad_limit.json()["error"]["param"]) == (400, "limit")


def test_no_healthy_site_refuses_the_batch(start_federation) -> None:
    lonely = start_federation(live=[], dead=("azure-jpe",))
    response = httpx.post(
        f"{lonely.base_url}/v1/batches",
        json={"model": "tiny", "requests": [item("a", "x", 1)]},
        timeout=30,
    )
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"]
    assert response.json()["error"]["code"] == "service_unavailable"
    assert counts(lonely) == (0, 0)


def test_items_of_a_site_that_dies_complete_elsewhere(start_federation) -> None:
    federation = start_federation(live=sorted(SITES), env={"GATEWAY_BATCH_SITE_CONCURRENCY": "2"})
    items = [item(f"s{i}", f"Describe place {i}", 150) for i in range(12)]
    with httpx.Client(base_url=federation.base_url, timeout=60) as client:
        batch = post_batch(client, {"model": "tiny", "requests": items}).json()
        deadline = time.monotonic() + 60
        while not any(r["status"] == "completed" for r in all_results(client, batch["id"], 100)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        federation.sites["gcp-euw4"].kill()
        done = wait_for(client, batch["id"])
        results = all_results(client, batch["id"], 100)
    assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert all(r["response"]["usage"]["completion_tokens"] == 150 for r in results)
    served = {str(row["id"]): row["site_name"] for row in federation.rows("r.status = 'completed'")}
    moved = [
        r
        for r in results
        if r["assignment"]["site"] == "gcp-euw4" and served[r["response"]["id"]] == "aws-use1"
    ]
    assert moved  # assigned to the dead site, answered by the live one
