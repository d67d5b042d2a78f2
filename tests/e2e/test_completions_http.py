"""The public API end to end: HTTP -> gateway -> gRPC -> site engine -> model -> back."""

from __future__ import annotations

import json

import httpx
import pytest

from devtools.launch import readiness
from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(live=["aws-use1", "gcp-euw4"], dead=["azure-jpe"])


@pytest.fixture
def client(federation: Federation):
    with httpx.Client(base_url=federation.base_url, timeout=60) as client:
        yield client


def test_completion(client, federation: Federation) -> None:
    response = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "Hello there", "max_tokens": 7, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 7,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},  # two tokens: not a full block
    }
    (row,) = federation.rows(f"r.id = '{body['id']}'")
    assert row["status"] == "completed"
    assert row["site_name"] == response.headers["x-fedllm-site"]
    assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (
        2,
        7,
        "length",
    )
    assert row["first_token_at"] is not None
    assert row["finished_at"] is not None


def test_streaming_completion(client, federation: Federation) -> None:
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    whole = {k: v for k, v in body.items() if k != "stream_options"}  # OpenAI: 400 without stream
    same = client.post("/v1/completions", json={**whole, "stream": False}).json()
    assert streamed == same["choices"][0]["text"]  # greedy: the same answer either way
    (row,) = federation.rows(f"r.id = '{chunks[0]['id']}'")
    assert row["status"] == "completed"
    assert row["stream"]


def test_round_robin_uses_every_healthy_site_and_never_the_dead_one(client) -> None:
    served = [
        client.post(
            "/v1/completions", json={"model": "tiny", "prompt": f"q{i}", "max_tokens": 2}
        ).headers["x-fedllm-site"]
        for i in range(6)
    ]
    assert sorted(set(served)) == ["aws-use1", "gcp-euw4"]
    assert served.count("aws-use1") == served.count("gcp-euw4") == 3


def test_models_and_readiness(client) -> None:
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    ready = readiness(str(client.base_url))
    assert ready["sites"] == {"aws-use1": True, "gcp-euw4": True, "azure-jpe": False}


BAD_INPUTS = [
    (b"{not json", 400, None),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    (b'{"model": "tiny"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": -5}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 10000000}', 400, "max_tokens"),
    (b'{"model": "gpt-17", "prompt": "hi"}', 404, "model"),
    (b'{"model": "tiny", "prompt": "hi", "n": 99}', 400, "n"),
    (b'{"model": "tiny", "prompt": "hi", "tools": [{}]}', 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_an_openai_error_and_writes_nothing(
    client, federation, body, status, param
) -> None:
    before = len(federation.rows())
    response = client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert len(federation.rows()) == before


def test_oversized_body_is_refused(client, federation) -> None:
    before = len(federation.rows())
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 2_000_000})
    assert response.status_code == 413
    assert "error" in response.json()
    assert len(federation.rows()) == before


def test_a_list_of_prompts_answers_each_with_n_choices(client) -> None:
    """OpenAI's list prompt: choices numbered prompt * n + choice, usage summed; greedy answers
    equal the single-prompt ones; streamed, the same choices arrive prompt by prompt."""
    prompts = ["Once upon a time", "The moon"]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0,
            "echo": True}  # fmt: skip
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    singles = [
        client.post("/v1/completions", json={**body, "prompt": p, "n": 1}).json() for p in prompts
    ]
    texts = [c["text"] for c in answer["choices"]]
    expected = [single["choices"][0]["text"] for single in singles for _ in range(2)]
    assert texts == expected
    assert all(
        t.startswith(p)
        for t, p in zip(texts, [prompts[0], prompts[0], *prompts[1:] * 2], strict=True)
    )
    assert answer["usage"]["completion_tokens"] == 12
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
    streamed = ["", "", "", ""]
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == texts
    assert events[-1]["usage"]["completion_tokens"] == 12
