"""POST /v1/chat/completions end to end: HTTP -> template -> gateway -> gRPC -> site -> back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.launch import LaunchError, free_port, start_gateway
from gateway.chat.templates import CHATML_TEMPLATE, ChatTemplate
from tests.e2e.conftest import Federation, write_federation

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the sea."},
]


def counts(usage: dict[str, Any]) -> dict[str, Any]:
    """Usage without its cached-token detail: a repeated prompt may find its blocks cached."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(live=["aws-use1", "gcp-euw4"])


@pytest.fixture
def client(federation: Federation) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=federation.base_url, timeout=60) as client:
        yield client


def chat(client: httpx.Client, **fields: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **fields}
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def stream_chat(client: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    body = {"model": "tiny", "messages": MESSAGES, "stream": True, **fields}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_chat_completion_is_the_templated_prompt_completed(client, federation) -> None:
    body = chat(client, max_completion_tokens=7, temperature=0, user="alice")
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    # The same model given the ChatML rendering as a plain completion answers the same (greedy).
    prompt = ChatTemplate.compile(CHATML_TEMPLATE, "test").render(MESSAGES)
    plain = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 7, "temperature": 0},
    ).json()
    assert choice["message"]["content"] == plain["choices"][0]["text"]
    assert counts(body["usage"]) == counts(plain["usage"])
    assert body["usage"]["completion_tokens"] == 7
    (row,) = federation.rows(f"r.id = '{body['id']}'")
    assert (row["api"], row["status"], row["user"]) == ("chat.completions", "completed", "alice")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (plain["usage"]["prompt_tokens"], 7)


def test_streaming_chat_with_usage_in_the_final_chunk(client, federation) -> None:
    chunks = stream_chat(
        client, max_tokens=6, temperature=0, stream_options={"include_usage": True}
    )
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0] == {
        "delta": {},
        "finish_reason": "length",
        "index": 0,
        "logprobs": None,
    }
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    same = chat(client, max_tokens=6, temperature=0)
    assert streamed == same["choices"][0]["message"]["content"]
    assert counts(usage_chunk["usage"]) == counts(same["usage"])
    (row,) = federation.rows(f"r.id = '{chunks[0]['id']}'")
    assert (row["api"], row["status"], row["stream"]) == ("chat.completions", "completed", True)


def test_streaming_without_usage_sends_no_usage_field(client) -> None:
    chunks = stream_chat(client, max_tokens=3, temperature=0)
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_sequence_ends_the_answer_before_it(client) -> None:
    fields = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = chat(client, **fields)["choices"][0]["message"]["content"]
    assert len(free) >= 8
    stop = free[5:8]
    stopped = chat(client, stop=[stop], **fields)["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["message"]["content"] == free[: free.index(stop)]


def test_seed_makes_sampling_reproducible(client) -> None:
    fields = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    first = chat(client, **fields)["choices"][0]["message"]["content"]
    assert chat(client, **fields)["choices"][0]["message"]["content"] == first


BAD_INPUTS = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"n": 2}, 400, "n"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, 400, "max_completion_tokens"),
    ({"max_completion_tokens": 10_000_000}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, 400, None),
    ({"model": "gpt-17"}, 404, "model"),
]


@pytest.mark.parametrize(("fields", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_an_openai_error_and_writes_nothing(
    client, federation, fields, status, param
) -> None:
    before = len(federation.rows())
    response = client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **fields}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"].startswith("messages[0].")
    assert len(federation.rows()) == before


def federation_with_template(tmp_path: Path, model_dir: Path, endpoint: str, template: str) -> Path:
    path = write_federation(tmp_path / "federation.json", model_dir, {"aws-use1": endpoint})
    data = json.loads(path.read_text())
    (tmp_path / "chat.jinja").write_text(template)
    data["models"][0]["chat_template"] = "chat.jinja"  # relative to the federation file
    path.write_text(json.dumps(data))
    return path


def test_a_configured_template_is_used(federation, tiny_llama_dir, tmp_path) -> None:
    """A second gateway over the same site, with the template set in its federation file."""
    site = federation.sites["aws-use1"]
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    gateway = start_gateway(
        federation_file=federation_with_template(
            tmp_path, tiny_llama_dir, f"127.0.0.1:{site.port}", template
        ),
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
        log_dir=tmp_path,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as own:
            body = chat(own, max_tokens=5, temperature=0)
            prompt = "[system] You are terse.\n[user] Tell me about the sea.\n"
            plain = own.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0},
            ).json()
    finally:
        gateway.stop()
    assert body["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert counts(body["usage"]) == counts(plain["usage"])


def test_a_broken_template_stops_the_gateway_with_a_clear_message(tiny_llama_dir, tmp_path) -> None:
    path = federation_with_template(
        tmp_path, tiny_llama_dir, f"127.0.0.1:{free_port()}", "{% for m in messages %}"
    )
    with pytest.raises(LaunchError, match=r"model 'tiny': chat template from .* does not compile"):
        start_gateway(
            federation_file=path,
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
            log_dir=tmp_path,
            timeout_s=60,
        )
