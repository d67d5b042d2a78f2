"""Forced tool calls (tool_choice required or named): the arguments held to the client's schema
with its objects closed, the constraint checked with the grammar engine the sites enforce it
with, and answers whose call markup never becomes content, whole or streamed, cut by max_tokens
or not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import pytest

from fedllm_contract.grammar import ConstraintSpec, grammar
from fedllm_contract.tokenizer import load_tokenizer
from gateway.chat.closed_objects import closed_arguments
from gateway.chat.response_format import response_constraint
from gateway.chat.tool_calls import ToolCallScanner, split_finished
from gateway.chat.tools import ToolRequest, tool_constraint
from gateway.dispatch.request import ToolCallParsing
from gateway.federation import ToolCallFormat

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_objects_that_declare_their_keys_are_closed_at_every_depth() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "stops": {"type": "array", "items": {"properties": {"name": {"type": "string"}}}},
            "either": {"anyOf": [{"$ref": "#/$defs/Unit"}, {"type": "null"}]},
        },
        "$defs": {"Unit": {"type": "object", "properties": {"u": {"enum": ["c", "f"]}}}},
    }
    closed = closed_arguments(schema)
    assert closed["additionalProperties"] is False
    properties = closed["properties"]
    assert properties["where"]["additionalProperties"] is False
    assert properties["stops"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["Unit"]["additionalProperties"] is False
    assert properties["either"] == schema["properties"]["either"]  # (a $ref and a null)
    assert "additionalProperties" not in schema  # the client's schema is left as it was


def test_what_closing_would_narrow_is_left_as_given() -> None:
    free_map = {"type": "object"}
    given = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}}
    undeclared_required = {"type": "object", "properties": {"a": {}}, "required": ["b"]}
    parts = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"properties": {"b": {}}}]}
    beside = {"type": "object", "properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]}
    negated = {"not": {"type": "object", "properties": {"a": {}}}}
    schema = {
        "type": "object",
        "properties": {
            "free": free_map,
            "given": given,
            "undeclared": undeclared_required,
            "parts": parts,
            "beside": beside,
            "negated": negated,
        },
    }
    properties = closed_arguments(schema)["properties"]
    assert properties == schema["properties"]


def test_a_function_without_declared_parameters_takes_none() -> None:
    assert closed_arguments({"type": "object"}) == {"type": "object", "additionalProperties": False}
    patterned = {"type": "object", "patternProperties": {"^x": {"type": "string"}}}
    assert closed_arguments(patterned) == patterned


@pytest.fixture(scope="module")
def llg_tokenizer(gpt2_tokenizer_dir: Path) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(load_tokenizer(gpt2_tokenizer_dir))


def accepts(tokenizer: llguidance.LLTokenizer, spec: ConstraintSpec, text: str) -> bool:
    """Whether the sites' grammar engine lets an answer be exactly `text`."""
    matcher = llguidance.LLMatcher(tokenizer, grammar(spec), log_level=0)
    tokens = tokenizer.tokenize_str(text)
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


def forced(parameters: dict[str, Any], choice: str = "get_weather") -> ConstraintSpec:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    spec = tool_constraint(ToolRequest((tool,), choice, True), ToolCallFormat())
    assert spec is not None
    return spec


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_forced_call_takes_no_key_its_schema_does_not_declare(llg_tokenizer) -> None:
    spec = forced(CITY)
    # (The schema goes with its keys sorted, as before: llguidance writes them in that order.)
    ok = '{"arguments": {"city": "Paris"}, "name": "get_weather"}'
    assert accepts(llg_tokenizer, spec, call(ok))
    extra = '{"arguments": {"city": "Paris", "country": "France"}, "name": "get_weather"}'
    assert not accepts(llg_tokenizer, spec, call(extra))
    nested = {"type": "object", "properties": {"where": CITY}, "required": ["where"]}
    spec = forced(nested, "required")
    ok = '{"arguments": {"where": {"city": "Paris"}}, "name": "get_weather"}'
    assert accepts(llg_tokenizer, spec, call(ok))
    extra = '{"arguments": {"where": {"city": "Paris", "zip": "75001"}}, "name": "get_weather"}'
    assert not accepts(llg_tokenizer, spec, call(extra))
    # A function declaring no parameters takes none.
    assert accepts(
        llg_tokenizer, forced({"type": "object"}), call('{"arguments": {}, "name": "get_weather"}')
    )
    assert not accepts(
        llg_tokenizer,
        forced({"type": "object"}),
        call('{"arguments": {"city": "Paris"}, "name": "get_weather"}'),
    )


def strict_format(schema: dict[str, Any], strict: bool | None) -> ConstraintSpec:
    spec: dict[str, Any] = {"name": "place", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    constraint = response_constraint({"type": "json_schema", "json_schema": spec})
    assert constraint is not None
    return constraint


def test_a_strict_response_format_takes_no_key_its_schema_does_not_declare(llg_tokenizer) -> None:
    # A pydantic model's schema sent strict: without additionalProperties.
    nested = {
        "type": "object",
        "properties": {"where": CITY, "tags": {"type": "array", "items": CITY}},
        "required": ["where", "tags"],
    }
    ok = '{"where": {"city": "Paris"}, "tags": [{"city": "Lyon"}]}'
    extras = [
        '{"where": {"city": "Paris"}, "tags": [], "country": "France"}',
        '{"where": {"city": "Paris", "zip": "75001"}, "tags": []}',
        '{"where": {"city": "Paris"}, "tags": [{"city": "Lyon", "zip": "69001"}]}',
    ]
    strict = strict_format(nested, True)
    assert accepts(llg_tokenizer, strict, ok)
    for extra in extras:
        assert not accepts(llg_tokenizer, strict, extra), extra
    # The client's order is kept: the grammar writes keys in it.
    assert list(json.loads(strict.schema)["properties"]) == ["where", "tags"]
    # Not strict: JSON Schema's reading, other keys allowed, as before (None: instructor 1.17.0's
    # JSON_SCHEMA mode, which sends no `strict` key).
    for loose in (strict_format(nested, False), strict_format(nested, None)):
        assert all(accepts(llg_tokenizer, loose, extra) for extra in extras)
    # Free-form maps (no declared properties) and explicit additionalProperties stay as given.
    maps = {
        "type": "object",
        "properties": {"labels": {"type": "object"}, "counts": {
            "type": "object", "additionalProperties": {"type": "integer"}}},
        "required": ["labels", "counts"],
    }  # fmt: skip
    assert accepts(
        llg_tokenizer, strict_format(maps, True), '{"labels": {"a": "b"}, "counts": {"x": 1}}'
    )


WEATHER = ToolCallParsing("<tool_call>\n", "\n</tool_call>", frozenset({"get_weather"}))
FORCED = ToolCallParsing(WEATHER.begin, WEATHER.end, WEATHER.names, forced=True)
LEGACY = ToolCallParsing(WEATHER.begin, WEATHER.end, WEATHER.names, legacy_functions=True)
PARIS = call('{"name": "get_weather", "arguments": {"city": "Paris"}}')
CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
UNNAMED = '<tool_call>\n{"name": "get_wea'


@pytest.mark.parametrize(
    "parameters",
    [
        {},
        {"properties": {"city": {"type": "string"}}},
        {"type": ["object", "array"]},
        {"anyOf": [{"type": "array"}, {"type": "object", "properties": {"city": {}}}]},
    ],
    ids=["empty", "untyped-properties", "type-list", "anyOf"],
)
def test_a_forced_calls_arguments_are_an_object_whatever_the_schema_leaves_open(
    llg_tokenizer, parameters: dict[str, Any]
) -> None:
    """Issue 58: with `parameters: {}` SmolLM2 wrote a list as arguments, which is no call."""
    spec = forced(parameters)
    for value in ("[]", '["Paris"]', '"Paris"', "1", "null"):
        written = call(f'{{"arguments": {value}, "name": "get_weather"}}')
        assert not accepts(llg_tokenizer, spec, written), (parameters, value)
    assert accepts(llg_tokenizer, spec, call('{"arguments": {}, "name": "get_weather"}'))
    # The call parses as a call (the answer side drops a non-object as no call).
    body = '{"arguments": {}, "name": "get_weather"}'
    assert split_finished(call(body), FORCED, "stop").finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("parsing", "text", "reason", "expected"),
    [
        # Forced: nothing but calls, the separators included.
        (FORCED, PARIS, "stop", (None, 1, "tool_calls")),
        (FORCED, f"{PARIS}\n{PARIS}", "stop", (None, 2, "tool_calls")),
        # A call cut by max_tokens is returned as written, with finish_reason "length"...
        (FORCED, f"{PARIS}\n{CUT}", "length", (None, 2, "length")),
        (FORCED, CUT, "length", (None, 1, "length")),
        # ...markup cut before any call began is dropped.
        (FORCED, f"{PARIS}\n<tool", "length", (None, 1, "tool_calls")),
        (FORCED, '<tool_call>\n{"na', "length", (None, 0, "length")),
        # auto: text stays content; a cut call is a call, never content.
        (WEATHER, f"Let me look.\n{PARIS}", "stop", ("Let me look.", 1, "tool_calls")),
        (WEATHER, f"Let me look.\n{CUT}", "length", ("Let me look.", 1, "length")),
        (WEATHER, f"{PARIS}\n{CUT}", "length", (None, 2, "length")),
        (WEATHER, "Sunny and warm", "length", ("Sunny and warm", 0, "length")),
        (WEATHER, f"{PARIS} then more words", "length", ("then more words", 1, "length")),
        # An answer the model itself ended inside markup that began no call keeps it as text;
        # inside a begun call, the call stands.
        (WEATHER, UNNAMED, "stop", (UNNAMED, 0, "stop")),
        (WEATHER, CUT, "stop", (None, 1, "tool_calls")),
        # A legacy caller's answer: finish_reason function_call.
        (LEGACY, PARIS, "stop", (None, 1, "function_call")),
    ],
)
def test_whole_answers_never_carry_call_markup_as_content(parsing, text, reason, expected) -> None:
    split = split_finished(text, parsing, reason)
    assert (split.content, len(split.calls), split.finish_reason) == expected
    for found in split.calls:
        assert found.function.name == "get_weather"
        assert found.function.arguments in ('{"city": "Paris"}', '{"city": "Par')


def streamed(parsing: ToolCallParsing, text: str, reason: str) -> tuple[str, int, str | None]:
    scanner = ToolCallScanner(parsing)
    parts = [part for i in range(0, len(text), 4) for part in scanner.feed(text[i : i + 4])]
    parts += scanner.flush(reason)  # type: ignore[arg-type]
    content = "".join(part for part in parts if isinstance(part, str))
    return content, len(scanner.calls), scanner.finish_reason(reason)  # type: ignore[arg-type]


def test_streamed_answers_never_carry_call_markup_as_content() -> None:
    assert streamed(FORCED, f"{PARIS}\n{PARIS}\n{CUT}", "length") == ("", 3, "length")
    assert streamed(FORCED, f"{PARIS}\n{PARIS}\n<tool_c", "length") == ("", 2, "tool_calls")
    assert streamed(FORCED, CUT, "length") == ("", 1, "length")
    assert streamed(WEATHER, f"Hm. {PARIS}\n{CUT}", "length") == ("Hm. \n", 2, "length")
    assert streamed(WEATHER, "Hm. <tool", "length") == ("Hm. ", 0, "length")
    assert streamed(WEATHER, "Hm. <tool", "stop") == ("Hm. <tool", 0, "stop")
