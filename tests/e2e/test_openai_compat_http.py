"""The OpenAI API as newer clients call it (issue 49), against real SmolLM2 sites through the
openai SDK: the fields today's SDKs and agent frameworks send that change no answer here,
accepted and ignored (the same greedy answer as without them; `service_tier` echoed as
served), while values OpenAI itself refuses stay 400s; a prompt past the context blamed on
`messages`; the legacy `functions` mapped onto tools and answered in the legacy shape; forced
tool calls with a permissive schema (no `additionalProperties: false`) that always come back as
valid calls, never as `<tool_call>` markup in the content, whole or streamed, and a forced tool
with `parameters: {}` called with object arguments (issue 58); and a batch of such requests
whose usage totals its lines' cached prompt tokens."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema_rs
import openai
import pytest
from openai.types import Batch
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionToolChoiceOptionParam,
    ChatCompletionToolParam,
)
from openai.types.chat.completion_create_params import Function

from tests.e2e.conftest import wait_until_written
from tests.e2e.smollm2_federation import MODEL, RealFederation, smollm2_federation

pytestmark = pytest.mark.slow

ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris right now?"}
]
# As clients write it: properties and required, additionalProperties left unset.
PERMISSIVE: dict[str, object] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
DESCRIPTION = "The current weather in a city"
FUNCTION: Function = {"name": "get_weather", "description": DESCRIPTION, "parameters": PERMISSIVE}
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PERMISSIVE},
}
TRIES = 12  # the count: 4 of 12 forced calls came back as markup at max_tokens 64
MARKUP = "<tool_call"


@pytest.fixture(scope="module")
def federation(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealFederation]:
    with smollm2_federation(smollm2_gguf, smollm2_dir, tmp_path_factory.mktemp("compat")) as fed:
        yield fed


@pytest.fixture(scope="module")
def client(federation: RealFederation) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{federation.base_url}/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        yield client


# What newer SDKs and frameworks send (pydantic-ai, langchain-openai, litellm pass them through
# from their settings): each one OpenAI accepts for a text model.
IGNORED: dict[str, Any] = {
    "metadata": {"team": "search", "run": "nightly-7"},
    "store": True,
    "reasoning_effort": "low",
    "verbosity": "low",
    "prediction": {"type": "content", "content": "Paris is the capital of France."},
    "service_tier": "flex",
    "safety_identifier": "user-4711",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "modalities": ["text"],
    "parallel_tool_calls": True,
}
CAPITAL: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


def test_the_fields_newer_clients_send_are_accepted_and_change_no_answer(
    client: openai.OpenAI,
) -> None:
    plain = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_completion_tokens=24
    )
    lenient = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_completion_tokens=24, **IGNORED
    )
    assert lenient.choices[0].message.content == plain.choices[0].message.content
    # The tier each was served in, as OpenAI tells it (flex: the flex priority class).
    assert (plain.service_tier, lenient.service_tier) == ("default", "flex")
    # An older spelling, through extra_body as a client whose SDK lacks it would send it.
    older = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_completion_tokens=24,
        extra_body={"prompt_cache_retention": "in-memory"},
    )
    assert older.choices[0].message.content == plain.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_completion_tokens=24,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        **IGNORED,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage is not None
    assert {chunk.service_tier for chunk in chunks} == {"flex"}


def test_a_prompt_past_the_context_is_reported_against_messages(client: openai.OpenAI) -> None:
    """Issue 58: a prompt that alone leaves no room was blamed on max_tokens. The site's
    context is 8,192 tokens; "hello " is one token."""
    long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello " * 9000}]
    for limit in (openai.omit, 16):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=long, max_tokens=limit)
        assert (caught.value.param, caught.value.code) == ("messages", "context_length_exceeded")
        assert "your messages resulted in" in caught.value.message
    # A prompt that fits with a limit that does not: still the limit's.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8190)
    assert (caught.value.param, caught.value.code) == ("max_tokens", "context_length_exceeded")


def request_rows(federation: RealFederation) -> int:
    wait_until_written(federation.base_url)
    with sqlite3.connect(federation.database) as db:
        return int(db.execute("SELECT count(*) FROM requests").fetchone()[0])


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "mp3"}},
     "modalities"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    ({"function_call": "auto"}, "function_call"),
]  # fmt: skip


def test_values_openai_refuses_stay_400s_and_dispatch_nothing(
    client: openai.OpenAI, federation: RealFederation
) -> None:
    before = request_rows(federation)
    for fields, param in REFUSED:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, extra_body=fields)
        body = caught.value.body
        assert isinstance(body, dict)
        assert body.get("param") == param, (fields, body)
    assert request_rows(federation) == before


def valid_arguments(arguments: str) -> bool:
    return bool(jsonschema_rs.validator_for(PERMISSIVE).is_valid(json.loads(arguments)))


def test_legacy_functions_are_called_and_answered_in_their_shape(client: openai.OpenAI) -> None:
    forced = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        functions=[FUNCTION],
        function_call={"name": "get_weather"},
        temperature=0,
        max_tokens=64,
    )
    choice = forced.choices[0]
    assert choice.finish_reason == "function_call"
    call = choice.message.function_call
    assert call is not None
    assert call.name == "get_weather"
    assert valid_arguments(call.arguments)
    assert (choice.message.content, choice.message.tool_calls) == (None, None)
    # The call and its answer back, as a legacy client sends them.
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None,
         "function_call": {"name": call.name, "arguments": call.arguments}},
        {"role": "function", "name": "get_weather", "content": "18 degrees celsius and sunny"},
    ]  # fmt: skip
    final = client.chat.completions.create(
        model=MODEL,
        messages=history,
        functions=[FUNCTION],
        temperature=0,
        max_tokens=48,
    )
    assert final.choices[0].message.content
    assert final.choices[0].message.function_call is None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        functions=[FUNCTION],
        function_call={"name": "get_weather"},
        temperature=0,
        max_tokens=64,
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    calls = [c.delta.function_call for c in chunks if c.delta.function_call]
    # Streamed as written: the name first, then the arguments piece by piece.
    assert calls[0].name == call.name
    assert all(c.name is None for c in calls[1:])
    assert len(calls) > 2
    assert "".join(c.arguments or "" for c in calls) == call.arguments
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["function_call"]


async def forced_calls(
    base_url: str,
    stream: bool,
    tool: ChatCompletionToolParam = WEATHER,
    tool_choice: ChatCompletionToolChoiceOptionParam = "required",
) -> list[tuple[str | None, list[str], str]]:
    """TRIES forced calls at max_tokens 64 and temperature 1, sent together: per try, its
    content, its calls' arguments and its finish reason."""
    async with openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:

        async def one(seed: int) -> tuple[str | None, list[str], str]:
            fields: dict[str, Any] = {
                "model": MODEL, "messages": ASK, "tools": [tool], "tool_choice": tool_choice,
                "max_tokens": 64, "temperature": 1.0, "seed": seed,
            }  # fmt: skip
            if not stream:
                answer = await client.chat.completions.create(**fields)
                choice = answer.choices[0]
                calls = [c.function.arguments for c in choice.message.tool_calls or []]
                return choice.message.content, calls, str(choice.finish_reason)
            content, by_index, reason = "", dict[int, str](), ""
            async for chunk in await client.chat.completions.create(**fields, stream=True):
                for delta_choice in chunk.choices:
                    content += delta_choice.delta.content or ""
                    for call in delta_choice.delta.tool_calls or []:
                        assert call.function is not None
                        # A call's arguments come in pieces, joined by the call's index.
                        by_index[call.index] = (by_index.get(call.index) or "") + (
                            call.function.arguments or ""
                        )
                    reason = delta_choice.finish_reason or reason
            return content or None, list(by_index.values()), reason

        return await asyncio.gather(*(one(seed) for seed in range(TRIES)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_with_a_permissive_schema_are_valid_calls_never_markup(
    federation: RealFederation, stream: bool
) -> None:
    answers = asyncio.run(forced_calls(federation.base_url, stream))
    for content, calls, reason in answers:
        assert content is None or MARKUP not in content, answers
        assert not (content or "").strip(), answers
        assert calls, answers
        assert reason in ("tool_calls", "length"), answers
        # Parallel calls allowed: max_tokens may cut a later call, which then comes back as
        # written with finish_reason "length" (issue 67); every call before it is whole.
        whole = calls[:-1] if reason == "length" else calls
        assert whole, answers
        assert all(valid_arguments(arguments) for arguments in whole), answers
        # Closed to the schema's keys: nothing invented beside them.
        assert all(set(json.loads(a)) <= {"city", "unit"} for a in whole), answers


# A tool declaring no parameter schema of its own, as agents write a no-argument tool.
NO_PARAMETERS: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time", "parameters": {}},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_with_an_empty_schema_is_called_with_object_arguments(
    federation: RealFederation, stream: bool
) -> None:
    """Issue 58: SmolLM2 wrote a list as the arguments of `parameters: {}` (3 of 6), which
    came back as no call with finish_reason "stop". The arguments are now held to an object."""
    named: ChatCompletionToolChoiceOptionParam = {
        "type": "function",
        "function": {"name": "get_time"},
    }
    answers = asyncio.run(forced_calls(federation.base_url, stream, NO_PARAMETERS, named))
    for content, calls, reason in answers:
        assert not (content or "").strip(), answers
        assert len(calls) == 1, answers
        assert reason == "tool_calls", answers
        assert json.loads(calls[0]) == {}, answers  # no parameters declared: none taken


SYSTEM = "You are a meteorologist. " + " ".join(
    f"Rule {i}: answer briefly and precisely about the weather." for i in range(12)
)


def batch_line(index: int) -> dict[str, Any]:
    """Line 0 a legacy caller's, lines 1-3 with the fields newer clients send, the rest plain;
    all with one system prompt, whose blocks the sites' prefix caches share among them."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is the weather in city number {index}?"},
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    if index == 0:
        body.update(functions=[FUNCTION], function_call={"name": "get_weather"}, max_tokens=64)
    elif index <= 3:
        body.update({k: v for k, v in IGNORED.items() if k != "parallel_tool_calls"})
    return {"custom_id": f"q-{index}", "method": "POST", "url": "/v1/chat/completions",
            "body": body}  # fmt: skip


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 600) -> Batch:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in (
        "completed", "failed", "expired", "cancelled",
    ):  # fmt: skip
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    return batch


def test_a_batch_totals_its_lines_cached_tokens_and_takes_these_fields(
    client: openai.OpenAI,
) -> None:
    lines = b"".join(json.dumps(batch_line(i)).encode() + b"\n" for i in range(8))
    uploaded = client.files.create(file=("compat.jsonl", io.BytesIO(lines)), purpose="batch")
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_done(client, created.id)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None
    output = client.files.content(batch.output_file_id).text
    answers = {
        row["custom_id"]: row["response"]["body"] for row in map(json.loads, output.splitlines())
    }
    # The batch's usage is its answered lines' usage summed, cached prompt tokens included.
    usages = [answer["usage"] for answer in answers.values()]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0  # the lines share their system prompt's blocks
    assert batch.usage is not None
    assert batch.usage.input_tokens_details.cached_tokens == cached
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages)
    # Every line was taken, the legacy caller's answered in its shape.
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (8, 0)
    legacy = answers["q-0"]["choices"][0]
    assert legacy["finish_reason"] == "function_call"
    assert valid_arguments(legacy["message"]["function_call"]["arguments"])
