"""The gateway's check of decoding constraints (issue 48): schemas past the grammar engine's
bounds are 400s naming the parameter before anything is dispatched, the check covers the
constraint as it is dispatched (a forced tool call's grammar whole), tools whose parameters use
$defs are enforceable, the gateway's verdict on a constraint is the site's (its compiler for a
real tokenizer), and the JSON the grammar allows is json.dumps' form (issue 49)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedllm_contract.grammar import (
    MAX_ANY_OF_BRANCHES,
    MAX_OPTIONAL_PROPERTIES,
    MAX_SCHEMA_BYTES,
    ConstraintSpec,
    refusal,
)
from fedllm_contract.tokenizer import load_tokenizer
from gateway.api.chat_schemas import decode_chat_request
from gateway.chat.service import ChatService
from gateway.chat.templates import CHATML_TEMPLATE, ChatTemplate, ChatTemplates
from gateway.chat.tools import check_tools, tool_constraint
from gateway.db.session import create_engine, create_sessionmaker
from gateway.dispatch.request import PreparedCompletion
from gateway.errors import GatewayError, InvalidRequest
from gateway.federation import ModelConfig, ToolCallFormat
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers
from site_engine.engine.grammar_compiler import GrammarCompiler, GrammarWaits

USER = {"role": "user", "content": "Describe a place."}
PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def chat(gpt2_tokenizer_dir: Path) -> ChatService:
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    settings = GatewaySettings(federation_file=Path("unused.json"))
    # prepare() must not touch the database: the log points at a database that is never created.
    unused_log = RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://")))
    completions = CompletionService(
        settings, SiteRegistry([]), tokenizers, build_policy("round_robin"), unused_log
    )
    templates = ChatTemplates({"m": ChatTemplate.compile(CHATML_TEMPLATE, "ChatML")})
    return ChatService(templates, tokenizers, completions)


@pytest.fixture(scope="module")
def site_compiler(gpt2_tokenizer_dir: Path) -> GrammarCompiler:
    tokenizer = load_tokenizer(gpt2_tokenizer_dir)
    return GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


def prepare(chat: ChatService, **fields: object) -> PreparedCompletion:
    body = {"model": "m", "messages": [USER], **fields}
    return chat.prepare(decode_chat_request(json.dumps(body).encode()))


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def objects(count: int) -> list[dict[str, Any]]:
    """`count` objects, each with its own required key (about 20 bytes a branch)."""
    return [{"required": [f"k{i}"]} for i in range(count)]


def refused(chat: ChatService, **fields: object) -> GatewayError:
    with pytest.raises(InvalidRequest) as caught:  # a 400
        prepare(chat, **fields)
    return caught.value


def test_the_issue_s_5000_branch_any_of_is_a_400_before_dispatch(chat: ChatService) -> None:
    """It passed the gateway, and the site's grammar engine gave up after `{"`: a 200 with
    finish_reason stop and content `{"`. The gateway now refuses it, saying where and why."""
    error = refused(chat, response_format=response_format({"anyOf": objects(5000)}))
    assert error.param == "response_format.json_schema.schema"
    assert "anyOf at / has 5000 branches" in error.message
    nested = {"type": "object", "properties": {"a": {"anyOf": objects(1001)}}}
    error = refused(chat, response_format=response_format(nested))
    assert "anyOf at /properties/a has 1001 branches" in error.message
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    assert "500 optional properties" in refused(chat, response_format=response_format(wide)).message
    assert prepare(chat, response_format=response_format({"anyOf": objects(MAX_ANY_OF_BRANCHES)}))
    strict = {**wide, "required": list(wide["properties"])}  # what strict mode sends
    assert prepare(chat, response_format=response_format(strict))
    assert MAX_OPTIONAL_PROPERTIES < 500


def test_a_schema_past_the_size_limit_is_a_400(chat: ChatService) -> None:
    big = {"type": "object", "properties": {f"p{i:05d}": {"type": "string"} for i in range(9000)},
           "required": [f"p{i:05d}" for i in range(9000)]}  # fmt: skip
    assert len(json.dumps(big)) > MAX_SCHEMA_BYTES
    error = refused(chat, response_format=response_format(big))
    assert error.param == "response_format.json_schema.schema"
    assert f"at most {MAX_SCHEMA_BYTES:,} are compiled" in error.message


def test_forced_calls_are_checked_as_they_are_dispatched(chat: ChatService) -> None:
    """Each tool's parameters may pass alone while the grammar of a forced call of any of
    them, which the site compiles, cannot be enforced: too large together here. A 400 at
    `tools`, not the site's refusal after dispatch (the prompt billed)."""
    names = [f"p{i:04d}" for i in range(4000)]
    params = {"type": "object", "properties": {name: {} for name in names}, "required": names}
    tools = [tool(f"f{i}", params) for i in range(4)]
    assert len(json.dumps(params)) < MAX_SCHEMA_BYTES < 4 * len(json.dumps(params))
    assert prepare(chat, tools=tools).params.options.constraint is None  # auto: nothing to enforce
    error = refused(chat, tools=tools, tool_choice="required")
    assert error.param == "tools"
    assert "the tool calls these tools ask for cannot be enforced" in error.message


def test_parameters_that_cannot_describe_an_object_are_a_400(chat: ChatService) -> None:
    """A call's arguments are an object (issue 58): a `type` without "object" is refused at
    the tool, as OpenAI refuses it; an empty schema is an object's (no parameters)."""
    error = refused(chat, tools=[tool("go", {"type": "string"})])
    assert error.param == "tools[0].function.parameters"
    assert "type 'object'" in error.message
    refused(chat, tools=[tool("go", {"type": ["array", "null"]})])
    spec = prepare(chat, tools=[tool("go", {})], tool_choice="required").params.options.constraint
    assert spec is not None
    assert refusal(spec) == ""


def test_tools_whose_parameters_use_defs_are_enforceable(chat: ChatService) -> None:
    """pydantic writes nested models under $defs; a forced call embeds the parameters in the
    call's schema, where "#/$defs/..." pointed at the call's root: the site refused it."""
    parameters = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}},
                  "required": ["where"], "$defs": {"Place": PLACE}}  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "go"}}):
        spec = prepare(
            chat, tools=[tool("go", parameters)], tool_choice=choice
        ).params.options.constraint
        assert spec is not None
        assert spec.kind == "tagged_json"
        assert refusal(spec) == ""


def test_the_dispatched_constraint_is_checked_whatever_built_it(chat: ChatService) -> None:
    """The options' last check (what every API's request passes through) refuses a
    constraint that no module before it checked."""
    from fedllm_contract.request_options import RequestOptions
    from gateway.completions.sampling_options import check_options

    bad = ConstraintSpec("json_schema", schema=json.dumps({"anyOf": objects(1500)}))
    with pytest.raises(GatewayError, match="1500 branches"):
        check_options(RequestOptions(constraint=bad), vocab=50257, max_choices=8)
    good = ConstraintSpec("json_schema", schema=json.dumps(PLACE))
    assert check_options(RequestOptions(constraint=good), 50257, 8).constraint == good


def forced_call(parameters: dict[str, Any]) -> ConstraintSpec:
    request = check_tools([tool("f", parameters)], "required", None)
    assert request is not None
    spec = tool_constraint(request, ToolCallFormat())
    assert spec is not None
    return spec


def schema(value: object) -> ConstraintSpec:
    return ConstraintSpec("json_schema", schema=json.dumps(value))


AGREED = {
    "object": ConstraintSpec("json_object"),
    "schema": schema(PLACE),
    "tool with $defs": forced_call(
        {
            "type": "object",
            "properties": {"where": {"$ref": "#/$defs/Place"}},
            "required": ["where"],
            "$defs": {"Place": PLACE},
        }
    ),
    "recursive tool": forced_call(
        {"type": "object", "properties": {"next": {"$ref": "#"}, "n": {"type": "integer"}}}
    ),
    "uniqueItems": schema({"type": "array", "uniqueItems": True}),
    "object oneOf": schema(
        {"oneOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]}
    ),
    "dangling $ref": schema({"properties": {"a": {"$ref": "#/$defs/None"}}}),
    "1001 branches": schema({"anyOf": [{"const": i} for i in range(1001)]}),
    "401 optional properties": schema({"properties": {f"p{i}": {} for i in range(401)}}),
    "too large": schema({"description": "x" * MAX_SCHEMA_BYTES, "type": "object"}),
    "not an object": ConstraintSpec("json_schema", schema="[]"),
    "not JSON": ConstraintSpec("json_schema", schema="{"),
    "tagged bounds": ConstraintSpec(
        "tagged_json", schema="{}", begin="<", end=">", min_items=3, max_items=2
    ),
}
REFUSED = {"uniqueItems", "object oneOf", "dangling $ref", "1001 branches",
           "401 optional properties", "too large", "not an object", "not JSON",
           "tagged bounds"}  # fmt: skip


def test_the_gateway_and_the_site_give_one_verdict(site_compiler: GrammarCompiler) -> None:
    """The gateway refuses exactly what a site would: refusal() (the gateway's check, without
    a tokenizer) and the site's compile for its tokenizer agree on each constraint, the tool
    whose parameters use $defs among them (passed by the gateway, refused by the site)."""
    for name, spec in AGREED.items():
        gateway = refusal(spec)
        try:
            site_compiler.guide(spec)
            site = ""
        except ValueError as exc:
            site = str(exc)
        assert bool(gateway) == bool(site) == (name in REFUSED), (name, gateway, site)


# Keys in sorted order: a forced call's schema is sent with its keys sorted (gateway/chat/
# tools.py), and the grammar holds an answer's keys to its schema's order.
ANSWER = {"at": {"city": "Lima"}, "name": "Ann", "tags": [1, 2]}
FORMAT = {
    "type": "object",
    "properties": {"at": PLACE, "name": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "integer"}}},
    "required": ["at", "name", "tags"],
    "additionalProperties": False,
}  # fmt: skip
LAYOUTS: dict[str, tuple[Callable[[object], str], bool]] = {
    "json.dumps": (json.dumps, True),
    "indented": (lambda v: json.dumps(v, indent=2), False),
    "newline after a comma": (lambda v: json.dumps(v).replace(", ", ",\n", 1), False),
    "two spaces": (lambda v: json.dumps(v).replace(": ", ":  ", 1), False),
    "compact": (lambda v: json.dumps(v, separators=(",", ":")), False),
}


def test_structured_output_is_written_as_json_dumps_writes_it(
    site_compiler: GrammarCompiler, gpt2_tokenizer_dir: Path
) -> None:
    """Issue 49: up to 24 whitespace characters were allowed between any two tokens, and a
    small model filled them with newlines. The grammar now allows one layout: ", " between
    items, ": " after keys, nothing else (json.dumps' default, the form chat templates write
    earlier tool calls in), for schemas, any object and tool calls alike."""
    tokenizer = load_tokenizer(gpt2_tokenizer_dir)
    call = {"arguments": ANSWER, "name": "f"}
    fmt = ToolCallFormat()
    cases = [(schema(FORMAT), ANSWER, "", ""), (ConstraintSpec("json_object"), ANSWER, "", ""),
             (forced_call(FORMAT), call, fmt.begin, fmt.end)]  # fmt: skip
    for spec, value, begin, end in cases:
        for name, (layout, allowed) in LAYOUTS.items():
            guide = site_compiler.guide(spec)
            tokens = tokenizer.encode(begin + layout(value) + end)
            taken = all(map(guide.consume, tokens)) and guide.matcher.is_accepting()
            assert taken == allowed, (spec.kind, name)


def test_an_answer_s_keys_come_in_the_schema_s_order(
    chat: ChatService, site_compiler: GrammarCompiler, gpt2_tokenizer_dir: Path
) -> None:
    """The schema was sent with its keys sorted, so an answer's keys came alphabetically:
    a schema's `reasoning` after its `answer`. OpenAI writes them in the schema's order."""
    ordered = {"type": "object", "properties": {"reasoning": {"type": "string"},
               "answer": {"type": "integer"}}, "required": ["reasoning", "answer"]}  # fmt: skip
    spec = prepare(chat, response_format=response_format(ordered)).params.options.constraint
    assert spec is not None
    tokenizer = load_tokenizer(gpt2_tokenizer_dir)
    for answer, allowed in (('{"reasoning": "2+2", "answer": 4}', True),
                            ('{"answer": 4, "reasoning": "2+2"}', False)):  # fmt: skip
        guide = site_compiler.guide(spec)
        taken = all(map(guide.consume, tokenizer.encode(answer))) and guide.matcher.is_accepting()
        assert taken == allowed, answer


def test_a_compile_done_after_the_polls_collect_is_cached_once(
    site_compiler: GrammarCompiler,
) -> None:
    """The last request waiting for a grammar can take its guide from a compile that finished
    after that poll's `collect`: the grammar is cached then, not compiled again by the next
    request of the same schema (CI once saw two constraints counted as one compile)."""
    spec = ConstraintSpec("json_schema", schema=json.dumps({"type": "object", "title": "late"}))
    before = site_compiler.compiled
    waits = GrammarWaits(site_compiler)
    waits.add("r", spec)
    compilation = site_compiler.submit(spec)  # the same compile, running or done
    site_compiler.wait([compilation], timeout_s=30.0)
    assert compilation.done
    # As if it finished between this poll's collect and its outcome.
    assert site_compiler.outcome(compilation, time.monotonic()) is not None
    assert site_compiler.compiled == before + 1
    assert site_compiler.cached(spec) is not None
    ready, failed = waits.settle(time.monotonic())
    assert list(ready) == ["r"]
    assert not failed
    assert site_compiler.compiled == before + 1
