"""The Responses API as newer clients call it, against real SmolLM2 sites of both kinds (one
gRPC site engine, one site of kind `openai`: an engine's OpenAI-compatible HTTP face), with API
keys on: the openai SDK's `responses.create` (plain, streamed through the SDK's own event
accumulator, structured output through `responses.parse`, a function-call round trip,
`previous_response_id`), GET / DELETE / input_items, `store: false`, ownership across two keys,
usage billed to the key like chat's; LangChain's `ChatOpenAI(use_responses_api=True)` and
LiteLLM's `responses()`; and what is not served refused with 400 naming the parameter, with
nothing dispatched."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import FunctionToolParam, ResponseInputParam
from pydantic import BaseModel, Field

from tests.e2e.conftest import wait_until_written
from tests.e2e.smollm2_federation import MODEL, RealFederation, smollm2_federation
from tests.support.api_keys import make_key

pytestmark = pytest.mark.slow

ADMIN = "responses-admin-token-0123456789"
GRPC_SITE, OPENAI_SITE = "aws-use1", "gcp-euw4"
WEATHER: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK: ResponseInputParam = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def federation(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealFederation]:
    work = tmp_path_factory.mktemp("responses")
    env = {"GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN}
    with smollm2_federation(
        smollm2_gguf, smollm2_dir, work, gateway_env=env, openai_site=True
    ) as running:
        yield running


@pytest.fixture(scope="module")
def keys(federation: RealFederation) -> tuple[str, str]:
    return make_key(federation.base_url, ADMIN, "alice"), make_key(
        federation.base_url, ADMIN, "bob"
    )


def sdk(federation: RealFederation, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{federation.base_url}/v1", api_key=key, max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def alice(federation: RealFederation, keys: tuple[str, str]) -> Iterator[openai.OpenAI]:
    with sdk(federation, keys[0]) as client:
        yield client


@pytest.fixture(scope="module")
def bob(federation: RealFederation, keys: tuple[str, str]) -> Iterator[openai.OpenAI]:
    with sdk(federation, keys[1]) as client:
        yield client


def query(federation: RealFederation, sql: str, *args: object) -> list[tuple[Any, ...]]:
    wait_until_written(federation.base_url)
    with sqlite3.connect(federation.database) as db:
        return list(db.execute(sql, args).fetchall())


def test_a_plain_response_is_billed_and_recorded_like_chat(
    federation: RealFederation, alice: openai.OpenAI
) -> None:
    response = alice.responses.create(
        model=MODEL, input="Say hello.", max_output_tokens=12, temperature=0
    )
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message"
    assert response.output_text
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens > 0
    assert 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    rows = query(
        federation,
        "SELECT r.api, r.prompt_tokens, r.completion_tokens, r.status, k.name FROM requests r "
        "JOIN api_keys k ON k.id = r.api_key_id WHERE r.id = ?",
        response.id,
    )
    assert rows == [("responses", usage.input_tokens, usage.output_tokens, "completed", "alice")]


def test_a_streamed_response_through_the_sdk_accumulator(alice: openai.OpenAI) -> None:
    # An answer that ends by itself: the SDK's accumulator wants response.completed (one cut at
    # max_output_tokens ends in response.incomplete, as OpenAI's).
    with alice.responses.stream(
        model=MODEL, input="Say hello.", max_output_tokens=48, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas
    assert deltas == final.output_text
    assert final.usage is not None
    assert final.usage.output_tokens > 0


def test_structured_output_through_parse(alice: openai.OpenAI) -> None:
    response = alice.responses.parse(
        model=MODEL,
        input="Describe Paris as a city record.",
        text_format=City,
        max_output_tokens=60,
        temperature=0,
    )
    assert response.status == "completed", response
    assert isinstance(response.output_parsed, City)
    assert response.text is not None
    assert response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_a_function_call_round_trip(alice: openai.OpenAI) -> None:
    first = alice.responses.create(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        parallel_tool_calls=False, max_output_tokens=48,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather"
    assert call.call_id
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"}
    # The first answer's items sent back as they came (ids and statuses too), then the output.
    answer: list[Any] = [
        *ASK,
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"},
    ]
    second = alice.responses.create(
        model=MODEL, input=answer, tools=[WEATHER], max_output_tokens=24, temperature=0
    )
    assert second.output_text or any(item.type == "function_call" for item in second.output)
    assert second.usage is not None
    assert first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output


def test_a_streamed_function_call(alice: openai.OpenAI) -> None:
    events = list(
        alice.responses.create(
            model=MODEL,
            input=ASK,
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            parallel_tool_calls=False,
            max_output_tokens=48,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    for kind in (
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ):
        assert kind in kinds, kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert set(json.loads(done.arguments)) == {"city", "unit"}


def test_previous_response_id_continues_the_conversation(alice: openai.OpenAI) -> None:
    first = alice.responses.create(
        model=MODEL,
        input="My name is Ada.",
        instructions="Answer in one short sentence.",
        max_output_tokens=8,
        temperature=0,
    )
    second = alice.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert first.usage is not None
    assert second.usage is not None
    # The second prompt holds the first's input and output (not its instructions).
    assert second.usage.input_tokens >= first.usage.output_tokens + 10
    items = alice.responses.input_items.list(second.id)
    assert [item.type for item in items.data] == ["message"]
    assert items.data[0].to_dict() == {
        "type": "message",
        "id": items.data[0].id,
        "role": "user",
        "content": [{"type": "input_text", "text": "What is my name?"}],
        "status": "completed",
    }


def test_get_delete_and_ownership_across_keys(
    federation: RealFederation, alice: openai.OpenAI, bob: openai.OpenAI
) -> None:
    made = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    read = alice.responses.retrieve(made.id)
    assert read.id == made.id
    assert read.output_text == made.output_text
    assert read.usage == made.usage
    for attempt in (
        lambda: bob.responses.retrieve(made.id),
        lambda: bob.responses.delete(made.id),
        lambda: bob.responses.input_items.list(made.id),
        lambda: bob.responses.create(
            model=MODEL, input="Go on", previous_response_id=made.id, max_output_tokens=4
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    alice.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as gone:
        alice.responses.retrieve(made.id)
    assert gone.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        alice.responses.create(
            model=MODEL, input="Go on", previous_response_id=made.id, max_output_tokens=4
        )
    assert query(federation, "SELECT count(*) FROM responses WHERE id = ?", made.id) == [(0,)]


def test_store_false_keeps_nothing(federation: RealFederation, alice: openai.OpenAI) -> None:
    made = alice.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, temperature=0, store=False
    )
    assert made.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as refused:
        alice.responses.create(
            model=MODEL, input="Go on", previous_response_id=made.id, max_output_tokens=4
        )
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert query(federation, "SELECT count(*) FROM responses WHERE id = ?", made.id) == [(0,)]
    # Billed all the same.
    assert query(federation, "SELECT api FROM requests WHERE id = ?", made.id) == [("responses",)]


def test_an_idempotency_key_replays_the_stored_response(
    federation: RealFederation, keys: tuple[str, str]
) -> None:
    headers = {"Authorization": f"Bearer {keys[0]}", "Idempotency-Key": "responses-once"}
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "temperature": 0}
    url = f"{federation.base_url}/v1/responses"
    first = httpx.post(url, json=body, headers=headers, timeout=120)
    again = httpx.post(url, json=body, headers=headers, timeout=120)
    assert first.status_code == again.status_code == 200, again.text
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    made = first.json()["id"]
    assert query(federation, "SELECT count(*) FROM requests WHERE id = ?", made) == [(1,)]
    # A stored response is read whole: only background responses (not run here) stream back.
    auth = {"Authorization": headers["Authorization"]}
    streamed = httpx.get(f"{url}/{made}", params={"stream": "true"}, headers=auth, timeout=30)
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "stream"


def test_both_site_kinds_serve_responses(alice: openai.OpenAI) -> None:
    """The gateway always serves the Responses API over its chat path: a gRPC site and an
    `openai` site (which is sent token ids on /v1/completions) answer alike."""
    seen: set[str] = set()
    for _ in range(8):
        raw = alice.responses.with_raw_response.create(
            model=MODEL, input="Count to three.", max_output_tokens=6, temperature=0
        )
        response = raw.parse()
        assert response.output_text, response
        seen.add(raw.headers["x-fedllm-site"])
        if seen == {GRPC_SITE, OPENAI_SITE}:
            return
    raise AssertionError(f"only {seen} served")


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
     "input[0].call_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object",
      "properties": {"a": {"type": "array", "uniqueItems": True}}}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
]  # fmt: skip


def test_what_is_not_served_is_refused_by_name(
    federation: RealFederation, keys: tuple[str, str]
) -> None:
    before = query(federation, "SELECT count(*) FROM requests")
    headers = {"Authorization": f"Bearer {keys[0]}"}
    for fields, param in REFUSED:
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **fields}
        answer = httpx.post(
            f"{federation.base_url}/v1/responses", json=body, headers=headers, timeout=60
        )
        assert answer.status_code == 400, (fields, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param, (fields, error)
        assert error["type"] == "invalid_request_error"
    assert query(federation, "SELECT count(*) FROM requests") == before


def test_langchain_with_the_responses_api(
    federation: RealFederation, keys: tuple[str, str]
) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{federation.base_url}/v1",
        api_key=keys[0],  # type: ignore[arg-type]
        use_responses_api=True,
        max_tokens=12,  # type: ignore[call-arg]
        temperature=0,
        max_retries=0,
    )
    message = llm.invoke("Say hello.")
    assert message.text
    assert message.response_metadata["id"].startswith("resp_")
    assert message.usage_metadata is not None
    assert message.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream("Say hello."))
    assert "".join(chunk.text for chunk in chunks)


def test_litellm_responses(federation: RealFederation, keys: tuple[str, str]) -> None:
    import litellm

    response = litellm.responses(
        model=f"openai/{MODEL}",
        input="Say hello.",
        api_base=f"{federation.base_url}/v1",
        api_key=keys[0],
        max_output_tokens=12,
        temperature=0,
    )
    assert response.id.startswith("resp_")
    texts = [
        part.text
        for item in response.output
        if getattr(item, "type", None) == "message"
        for part in item.content
    ]
    assert "".join(texts)
    assert response.usage is not None
    assert response.usage.output_tokens > 0
