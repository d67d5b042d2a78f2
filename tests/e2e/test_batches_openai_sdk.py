"""The Files and Batch APIs as the official `openai` client calls them, against a real gateway
with keys required and two real sites: upload a JSONL file, create a batch from it, poll it until
done, download its output file; unchanged client code. Then what goes wrong: malformed lines,
a request its endpoint refuses, another key's file, a file deleted before the batch, an
oversized file: each a clear error, and nothing half-created."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch

from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow
ADMIN = "admin-token-for-the-batch-sdk-tests"
FILE_LIMIT = 200_000
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1", "gcp-euw4"],
        env={
            "GATEWAY_ADMIN_TOKEN": ADMIN,
            "GATEWAY_REQUIRE_API_KEYS": "true",
            "GATEWAY_FILE_MAX_BYTES": str(FILE_LIMIT),
            "GATEWAY_BATCH_SITE_CONCURRENCY": "2",
        },
    )


def make_key(federation: Federation, name: str) -> dict[str, Any]:
    response = httpx.post(
        f"{federation.base_url}/admin/api/keys",
        json={"name": name},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    made: dict[str, Any] = response.json()
    return made


@pytest.fixture(scope="module")
def keys(federation: Federation) -> dict[str, dict[str, Any]]:
    return {name: make_key(federation, name) for name in ("alice", "bob")}


def sdk(federation: Federation, key: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{federation.base_url}/v1", api_key=key["key"], max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def alice(federation: Federation, keys) -> Iterator[openai.OpenAI]:
    with sdk(federation, keys["alice"]) as client:
        yield client


@pytest.fixture(scope="module")
def bob(federation: Federation, keys) -> Iterator[openai.OpenAI]:
    with sdk(federation, keys["bob"]) as client:
        yield client


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(custom_id: str, question: str, tokens: int) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    }


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 180) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)


def counts(federation: Federation) -> tuple[object, ...]:
    (row,) = federation.query(
        "SELECT (SELECT count(*) FROM batches), (SELECT count(*) FROM batch_items), "
        "(SELECT count(*) FROM files)"
    )
    return row


def test_the_sdk_batch_flow_unchanged(
    alice: openai.OpenAI, federation: Federation, keys, tmp_path: Path
) -> None:
    requests = [chat_line(f"q-{i}", f"Tell me about topic {i}", 3 + 2 * i) for i in range(6)]
    path = tmp_path / "requests.jsonl"
    path.write_bytes(jsonl(requests))

    # The client code of OpenAI's batch guide, unchanged.
    with path.open("rb") as handle:
        uploaded = alice.files.create(file=handle, purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.filename) == (
        "file",
        "batch",
        "requests.jsonl",
    )
    assert uploaded.bytes == path.stat().st_size
    assert uploaded.expires_at is not None
    assert alice.files.retrieve(uploaded.id).id == uploaded.id
    assert uploaded.id in [f.id for f in alice.files.list(purpose="batch")]

    created = alice.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "sdk-test"},
    )
    assert created.status == "validating"
    assert (created.input_file_id, created.endpoint) == (uploaded.id, "/v1/chat/completions")
    assert created.completion_window == "24h"
    assert created.expires_at == created.created_at + 24 * 3600
    assert created.metadata == {"job": "sdk-test"}
    assert created.request_counts is not None
    assert created.request_counts.total == 6

    done = wait_done(alice, created.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)
    assert done.in_progress_at is not None
    assert done.finalizing_at is not None
    assert done.completed_at is not None
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.error_file_id is None  # nothing failed
    assert done.output_file_id is not None

    output = alice.files.content(done.output_file_id)
    lines = [json.loads(line) for line in output.text.splitlines()]
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in requests]
    for line, asked in zip(lines, requests, strict=True):
        assert line["id"].startswith("batch_req_")
        assert line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "chat.completion"
        assert response["request_id"] == body["id"]
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == asked["body"]["max_tokens"]
    result_file = alice.files.retrieve(done.output_file_id)
    assert (result_file.purpose, result_file.bytes) == ("batch_output", len(output.content))
    assert done.id in [b.id for b in alice.batches.list()]

    # The batch plan placed each item (by default a range of BlendServe's prefix tree per
    # site); the record is kept (an extension).
    results = httpx.get(
        f"{federation.base_url}/v1/batches/{done.id}/results",
        headers={"Authorization": f"Bearer {keys['alice']['key']}"},
        params={"limit": 100},
        timeout=30,
    ).json()["data"]
    assert {r["assignment"]["site"] for r in results} <= {"aws-use1", "gcp-euw4"}
    assert all(r["assignment"]["reason"].startswith("blend: range ") for r in results)

    # Each item's request row carries the key: its usage counts the batch's tokens.
    usage = httpx.get(
        f"{federation.base_url}/admin/api/keys/{keys['alice']['id']}/usage",
        headers={"Authorization": f"Bearer {ADMIN}"},
        params={"window_s": 3600},
        timeout=30,
    ).json()
    generated = sum(r["body"]["max_tokens"] for r in requests)
    assert usage["requests"] >= 6
    assert usage["completion_tokens"] >= generated

    # Deleting the input file leaves the batch and its results as they are.
    deleted = alice.files.delete(uploaded.id)
    assert (deleted.id, deleted.deleted) == (uploaded.id, True)
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(uploaded.id)
    assert alice.batches.retrieve(done.id).output_file_id == done.output_file_id


def test_completions_batch_with_a_failed_request_and_cancel(
    alice: openai.OpenAI, federation: Federation
) -> None:
    lines = [
        {
            "custom_id": f"c-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "tiny",
                "prompt": f"Story {i}",
                "max_tokens": 300,
                "ignore_eos": True,
            },
        }
        for i in range(12)
    ]
    uploaded = alice.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = alice.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/completions",
        completion_window="1h",  # type: ignore[arg-type]  # OpenAI takes "24h" only; here: hours
    )
    deadline = time.monotonic() + 60
    while alice.batches.retrieve(batch.id).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cancelling = alice.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(alice, batch.id)
    assert done.status == "cancelled"
    assert done.cancelled_at is not None
    assert done.error_file_id is not None
    stopped = [
        json.loads(line) for line in alice.files.content(done.error_file_id).text.splitlines()
    ]
    assert stopped
    for line in stopped:
        assert line["response"] is None
        assert line["error"]["code"] == "batch_cancelled"
    answered = 0
    if done.output_file_id is not None:
        answered = len(alice.files.content(done.output_file_id).text.splitlines())
    assert answered + len(stopped) == 12
    assert done.request_counts is not None
    assert done.request_counts.completed == answered


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n{oops\n',
         "line 2 of the file: not valid JSON"),
        (jsonl([{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}]),
         "line 1 of the file: method must be POST"),
        (jsonl([{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}]),
         "url '/v1/embeddings' is not an endpoint this gateway batches"),
        (jsonl([chat_line("a", "x", 1), chat_line("a", "y", 1)]),
         "line 2 of the file: custom_id 'a' is also the custom_id of line 1"),
        (jsonl([{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": 7}]),
         "body must be a JSON object"),
        (jsonl([{"custom_id": "a", "url": "/v1/completions", "body": {}}]),
         "missing required field `method`"),
        (b"\n\n", "the file holds no request"),
        (b"\xff\xfe", "not UTF-8"),
    ],
    ids=["not json", "method", "endpoint", "duplicate custom_id", "body", "field", "empty", "utf8"],
)  # fmt: skip
def test_malformed_files_are_refused_at_upload(
    alice: openai.OpenAI, federation: Federation, content: bytes, message: str
) -> None:
    before = counts(federation)
    with pytest.raises(openai.BadRequestError) as refused:
        alice.files.create(file=("bad.jsonl", content), purpose="batch")
    assert message in str(refused.value)
    assert counts(federation) == before


def test_lines_their_endpoint_refuses_go_to_the_error_file(
    alice: openai.OpenAI, federation: Federation
) -> None:
    """OpenAI's way: a line with bad parameters (or too long for the context) is that line's
    entry in the error file, with the status and error its endpoint would answer; the other
    lines run; the batch carries the usage of what ran."""
    good = chat_line("ok", "fine", 3)
    lines = [
        good,
        {**chat_line("zero", "x", 1), "body": {**good["body"], "max_tokens": 0}},
        {**chat_line("long", "x", 1), "body": {**good["body"], "max_tokens": 10_000_000}},
        {**chat_line("schema", "x", 1), "body": {**good["body"], "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}}},
    ]  # fmt: skip
    uploaded = alice.files.create(file=("mixed.jsonl", jsonl(lines)), purpose="batch")
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_done(alice, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 3)
    assert done.usage is not None
    assert done.usage.output_tokens == 3
    assert done.usage.total_tokens == done.usage.input_tokens + 3 > 3
    assert done.output_file_id is not None
    assert done.error_file_id is not None
    answered = [json.loads(x) for x in alice.files.content(done.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in answered] == ["ok"]
    errors = {
        line["custom_id"]: line["response"]
        for line in map(json.loads, alice.files.content(done.error_file_id).text.splitlines())
    }
    assert {
        name: (r["status_code"], r["body"]["error"]["param"]) for name, r in errors.items()
    } == {
        "zero": (400, "max_tokens"),
        "long": (400, "max_tokens"),
        "schema": (400, "response_format.json_schema.schema"),
    }


def test_requests_their_endpoint_refuses_fail_the_batch_whole(
    alice: openai.OpenAI, federation: Federation
) -> None:
    good = chat_line("ok", "fine", 2)
    cases = [
        ([good], "/v1/completions", "line 1 of", "not the batch's endpoint /v1/completions"),
        ([good, {**chat_line("m", "x", 1), "body": {**good["body"], "model": "other"}}],
         "/v1/chat/completions", "line 2 of", "a batch serves one model"),
        ([good, {**chat_line("s", "x", 1), "body": {**good["body"], "stream": True}}],
         "/v1/chat/completions", "line 2 of", "stream must be false"),
    ]  # fmt: skip
    for lines, endpoint, where, message in cases:
        uploaded = alice.files.create(file=("reqs.jsonl", jsonl(lines)), purpose="batch")
        before = counts(federation)
        with pytest.raises(openai.BadRequestError) as refused:
            alice.batches.create(
                input_file_id=uploaded.id,
                endpoint=endpoint,  # type: ignore[arg-type]
                completion_window="24h",
            )
        assert where in str(refused.value)
        assert message in str(refused.value)
        assert "no request of the batch was accepted" in str(refused.value)
        assert counts(federation) == before
    uploaded = alice.files.create(file=("reqs.jsonl", jsonl([good])), purpose="batch")
    for window in ("24", "0h", "1000h"):
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            alice.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/chat/completions",
                completion_window=window,  # type: ignore[arg-type]
            )


def test_another_keys_file_and_a_deleted_file(
    alice: openai.OpenAI, bob: openai.OpenAI, federation: Federation
) -> None:
    uploaded = alice.files.create(
        file=("mine.jsonl", jsonl([chat_line("a", "x", 1)])), purpose="batch"
    )
    before = counts(federation)
    with pytest.raises(openai.NotFoundError, match=f"No such File object: {uploaded.id}"):
        bob.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(uploaded.id)
    assert uploaded.id not in [f.id for f in bob.files.list()]
    assert counts(federation) == before
    assert alice.files.retrieve(uploaded.id).id == uploaded.id  # bob's delete did nothing

    alice.files.delete(uploaded.id)
    before = counts(federation)
    with pytest.raises(openai.NotFoundError, match="No such File object"):
        alice.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert counts(federation) == before


def test_an_oversized_file_is_refused_whole(alice: openai.OpenAI, federation: Federation) -> None:
    line = chat_line("big", "word " * 2000, 1)
    content = jsonl([{**line, "custom_id": f"big-{i}"} for i in range(FILE_LIMIT // 10_000 + 5)])
    assert len(content) > FILE_LIMIT
    before = counts(federation)
    with pytest.raises(openai.APIStatusError) as refused:
        alice.files.create(file=("big.jsonl", content), purpose="batch")
    assert refused.value.status_code == 413
    assert f"larger than {FILE_LIMIT} bytes" in str(refused.value)
    assert counts(federation) == before
    with pytest.raises(openai.BadRequestError, match="purpose 'assistants' is not served"):
        alice.files.create(file=("x.jsonl", jsonl([line])), purpose="assistants")
