"""Clients get what OpenAI would give them (issue 67), against real SmolLM2 sites of both kinds
(a gRPC site engine and the engine's OpenAI-compatible HTTP face), through clients nobody here
wrote (the openai SDK, LangChain):

- logprobs of an emoji answer carry each token's own bytes, which rebuild the text (chat, whole
  and streamed); completions' `text_offset` stays inside the text and `top_logprobs` keeps
  distinct partial tokens apart;
- an answer cut inside a character keeps what its logprobs' bytes say (issue 75);
- a `strict` response_format schema is enforced closed;
- a forced tool call cut by max_tokens comes back, as written, with finish_reason "length";
- tool-call arguments stream as they are written (the SDK's stream helper parses them
  piece by piece);
- an answer without max_tokens that never ends (its EOS banned) ends at its time with
  finish_reason "length" and its text, billed as returned, never a 504 (chat and Responses).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall
from openai.types.responses import ResponseFormatTextJSONSchemaConfigParam
from pydantic import BaseModel

from fedllm_contract.tokenizer import load_tokenizer
from tests.e2e.conftest import wait_until_written
from tests.e2e.smollm2_federation import MODEL, RealFederation, smollm2_federation
from tests.e2e.test_structured_outputs_http import ASK, WEATHER

pytestmark = pytest.mark.slow

# The answer's time when the client sets no limit, against a request deadline far beyond it.
OPEN_ANSWER_S, REQUEST_TIMEOUT_S = 8, 90
EMOJI = "😀"
SMILEY_SCHEMA = {
    "type": "object",
    "properties": {"emoji": {"enum": ["😀", "🎉", "🚀"]}},
    "required": ["emoji"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def federation(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealFederation]:
    work = tmp_path_factory.mktemp("clients")
    env = {
        "GATEWAY_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        "GATEWAY_OPEN_ANSWER_TIMEOUT_S": str(OPEN_ANSWER_S),
    }
    with smollm2_federation(
        smollm2_gguf, smollm2_dir, work, gateway_env=env, openai_site=True
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(federation: RealFederation) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{federation.base_url}/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        yield client


@pytest.fixture(scope="module")
def ids(smollm2_dir: Path) -> dict[str, list[int]]:
    tokenizer = load_tokenizer(smollm2_dir)
    return {
        "emoji": tokenizer.encode(EMOJI),
        # " \xf0\x9f": a space and the first two bytes of 🎉 (its other bytes are other tokens).
        "space_and_part": tokenizer.encode(" 🎉")[:1],
        "comma": tokenizer.encode(","),
        "eos": sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}),
    }


def test_logprobs_of_an_emoji_answer_rebuild_its_text(client: openai.OpenAI) -> None:
    """Issue 67's must-show: each piece of an emoji came back as U+FFFD, bytes [239, 191, 189],
    and the bytes joined no longer rebuilt the text."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Pick an emoji."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": SMILEY_SCHEMA, "strict": True},
        },
        "temperature": 0,
        "max_tokens": 30,
        "logprobs": True,
        "top_logprobs": 3,
    }
    completion = client.chat.completions.create(**fields)
    choice = completion.choices[0]
    text = choice.message.content or ""
    assert json.loads(text)["emoji"] in ("😀", "🎉", "🚀"), text
    assert choice.logprobs is not None
    content = choice.logprobs.content or []
    assert b"".join(bytes(token.bytes or []) for token in content) == text.encode()
    partial = [token for token in content if token.token == "\ufffd"]
    assert partial  # the emoji is split over tokens
    assert all(token.bytes != [239, 191, 189] for token in partial)
    for token in content:
        assert len({bytes(top.bytes or []) for top in token.top_logprobs}) == 3
    # Streamed: the same bytes, chunk by chunk.
    streamed, pieces = b"", ""
    for chunk in client.chat.completions.create(**fields, stream=True):
        for delta in chunk.choices:
            pieces += delta.delta.content or ""
            for token in (delta.logprobs.content or []) if delta.logprobs else []:
                streamed += bytes(token.bytes or [])
    assert pieces == text
    assert streamed == text.encode()


def test_completion_logprobs_of_emoji_stay_exact(
    client: openai.OpenAI, ids: dict[str, list[int]]
) -> None:
    """On /v1/completions `text_offset` ran past the end of the text and `top_logprobs` merged
    distinct partial tokens (3 asked, 1 returned)."""
    bias = {str(token): 100 for token in ids["emoji"]}
    for stream in (False, True):
        fields: dict[str, Any] = {"model": MODEL, "prompt": "Emoji:", "max_tokens": 9,
                                  "temperature": 0, "logit_bias": bias, "logprobs": 3}  # fmt: skip
        if stream:
            chunks = list(client.completions.create(**fields, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            tokens: list[str] = []
            offsets: list[int] = []
            tops: list[dict[str, float]] = []
            for c in chunks:
                if c.choices and c.choices[0].logprobs is not None:
                    tokens += c.choices[0].logprobs.tokens or []
                    offsets += c.choices[0].logprobs.text_offset or []
                    tops += c.choices[0].logprobs.top_logprobs or []
        else:
            choice = client.completions.create(**fields).choices[0]
            assert choice.logprobs is not None
            text = choice.text
            tokens = choice.logprobs.tokens or []
            offsets = choice.logprobs.text_offset or []
            tops = choice.logprobs.top_logprobs or []
        assert EMOJI in text
        assert len(tokens) == len(offsets) == len(tops) == 9
        assert offsets == sorted(offsets)
        assert max(offsets) < len(text)
        for token, offset in zip(tokens, offsets, strict=True):
            if not token.startswith("bytes:"):  # a whole token: its text is there
                assert text[offset : offset + len(token)] == token
        assert all(len(top) == 3 for top in tops), tops


def test_an_answer_cut_inside_a_character_keeps_what_its_logprobs_say(
    client: openai.OpenAI, ids: dict[str, list[int]]
) -> None:
    """Issue 75: max_tokens cut an answer inside an emoji; its text ended before the emoji and
    lost the space before it, while the last logprobs' bytes were [32, 240, 159]: joined, they
    no longer read as the text. Now the text holds what the bytes say, the cut character as
    U+FFFD (the bytes joined, read with errors="replace"), whole and streamed."""
    (token,) = ids["space_and_part"]
    fields: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello with emoji."}],
        "max_tokens": 3, "temperature": 0, "logprobs": True, "logit_bias": {str(token): 100},
    }  # fmt: skip
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None
    joined = b"".join(bytes(t.bytes or []) for t in choice.logprobs.content or [])
    assert joined == b" \xf0\x9f" * 3
    assert choice.message.content == joined.decode(errors="replace") == " \ufffd" * 3
    text, streamed = "", b""
    for chunk in client.chat.completions.create(**fields, stream=True):
        for delta in chunk.choices:
            text += delta.delta.content or ""
            for piece in (delta.logprobs.content or []) if delta.logprobs else []:
                streamed += bytes(piece.bytes or [])
    assert (text, streamed) == (choice.message.content, joined)


def test_a_strict_schema_is_enforced_closed(
    client: openai.OpenAI, ids: dict[str, list[int]]
) -> None:
    """A strict schema without additionalProperties: false (a pydantic model's, strict added)
    let the model invent keys. Here a bias pushes it to write another key after the first."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
    }
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is Paris in France? Answer in JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
        logit_bias={str(token): 100 for token in ids["comma"]},
        temperature=0,
        max_tokens=40,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert set(json.loads(choice.message.content or "")) == {"ok"}


def forced(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    }


# Cuts a forced call inside its arguments: `<tool_call>\n{"arguments": {"city": "Par...`.
CUT_AT = 14


def test_a_cut_tool_call_comes_back_as_written(
    client: openai.OpenAI, federation: RealFederation
) -> None:
    """A forced call cut by max_tokens was dropped: LangChain got an empty message."""
    whole = client.chat.completions.create(**forced(80)).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.tool_calls is not None
    complete = whole.message.tool_calls[0].function.arguments
    cut = client.chat.completions.create(**forced(CUT_AT)).choices[0]
    assert cut.finish_reason == "length"
    assert cut.message.content is None
    (call,) = cut.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert call.function.arguments
    assert complete.startswith(call.function.arguments)  # greedy: the same call, cut
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{federation.base_url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_tokens=CUT_AT,  # type: ignore[call-arg]
        temperature=0,
        max_retries=0,
    ).bind_tools([dict(WEATHER)], tool_choice="get_weather")
    message = llm.invoke([("user", "What is the weather in Paris right now?")])
    assert message.response_metadata["finish_reason"] == "length"
    (invalid,) = message.invalid_tool_calls
    assert invalid["name"] == "get_weather"
    assert invalid["args"] == call.function.arguments


class Weather(BaseModel):
    city: str
    unit: str


def test_tool_call_arguments_stream_as_they_are_written(client: openai.OpenAI) -> None:
    """A streamed call came as one piece at its end: instructor's partial streaming got
    nothing until then."""
    deltas: list[ChoiceDeltaToolCall] = []
    for chunk in client.chat.completions.create(**forced(80, stream=True)):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
    assert deltas[0].id
    assert deltas[0].function is not None
    assert deltas[0].function.name == "get_weather"
    assert len(deltas) > 4
    assert all(d.id is None and d.function and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert set(json.loads(arguments)) == {"city", "unit"}
    # The SDK's stream helper parses the arguments as they come, as instructor does.
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    partial: list[object] = []
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=80,
    ) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                partial.append(event.parsed_arguments)
        final = stream.get_final_completion()
    assert len(partial) > 4
    assert len({json.dumps(p, sort_keys=True) for p in partial}) > 2  # it grows
    (call,) = final.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Weather)


def billed(federation: RealFederation, request_id: str) -> tuple[str, int, str | None]:
    wait_until_written(federation.base_url)
    with sqlite3.connect(federation.database) as db:
        row = db.execute(
            "SELECT status, completion_tokens, finish_reason FROM requests WHERE id = ?",
            (request_id,),
        ).fetchone()
    return str(row[0]), int(row[1]), row[2]


def endless(ids: dict[str, list[int]]) -> dict[str, Any]:
    """A greedy answer whose EOS is banned: it never ends on its own."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one onwards, in words."}],
        "temperature": 0,
        "logit_bias": {str(token): -100 for token in ids["eos"]},
    }


def test_an_answer_without_max_tokens_ends_at_its_time(
    client: openai.OpenAI, federation: RealFederation, ids: dict[str, list[int]]
) -> None:
    """It ran to the request timeout: a 504, with ~3,750 tokens billed and nothing returned."""
    whole = client.chat.completions.create(**endless(ids))
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content
    assert whole.usage is not None
    tokens = whole.usage.completion_tokens
    assert 0 < tokens < 8192 - whole.usage.prompt_tokens  # not the context's end
    assert billed(federation, whole.id) == ("completed", tokens, "length")
    text, reason, usage = "", None, None
    for chunk in client.chat.completions.create(
        **endless(ids), stream=True, stream_options={"include_usage": True}
    ):
        for delta in chunk.choices:
            text += delta.delta.content or ""
            reason = delta.finish_reason or reason
        usage = chunk.usage or usage
    assert reason == "length"
    assert text
    assert usage is not None
    assert billed(federation, chunk.id)[1:] == (usage.completion_tokens, "length")


# An answer that cannot end within the context: its one string must be 20,000 characters long.
ENDLESS: dict[str, Any] = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 20000}},
    "required": ["story"],
}


def test_a_response_without_max_output_tokens_ends_at_its_time(
    client: openai.OpenAI, federation: RealFederation
) -> None:
    story: ResponseFormatTextJSONSchemaConfigParam = {
        "type": "json_schema",
        "name": "story",
        "schema": ENDLESS,
    }
    response = client.responses.create(
        model=MODEL, input="Tell me a story.", temperature=0, text={"format": story}
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text.startswith('{"story": "')
    assert response.usage is not None
    assert billed(federation, response.id) == ("completed", response.usage.output_tokens, "length")
