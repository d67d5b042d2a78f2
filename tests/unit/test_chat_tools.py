"""Chat requests with tools, structured outputs, the developer role and tool turns, as the chat
service prepares them (no site involved), and tool calls found in answers, whole or streamed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.api.chat_schemas import decode_chat_request
from gateway.chat.service import ChatService
from gateway.chat.templates import CHATML_TEMPLATE, ChatTemplate, ChatTemplates
from gateway.chat.tool_calls import ToolCallScanner, split_answer
from gateway.db.session import create_engine, create_sessionmaker
from gateway.dispatch.request import ToolCallParsing
from gateway.federation import ModelConfig
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers

# A template that renders tools itself (transformers' convention), as Qwen2.5's does.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}{% endfor %}[assistant]"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USER = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture(scope="module")
def chat(gpt2_tokenizer_dir: Path) -> ChatService:
    models = (ModelConfig("m", gpt2_tokenizer_dir), ModelConfig("native", gpt2_tokenizer_dir))
    tokenizers = ModelTokenizers(models)
    settings = GatewaySettings(federation_file=Path("unused.json"))
    # prepare() must not touch the database: the log points at a database that is never created.
    unused_log = RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://")))
    completions = CompletionService(
        settings, SiteRegistry([]), tokenizers, build_policy("round_robin"), unused_log
    )
    templates = ChatTemplates(
        {
            "m": ChatTemplate.compile(CHATML_TEMPLATE, "ChatML"),
            "native": ChatTemplate.compile(TOOLS_TEMPLATE, "test"),
        }
    )
    return ChatService(templates, tokenizers, completions)


def prepare(chat: ChatService, **fields: object):
    body = {"model": "m", "messages": [USER], **fields}
    return chat.prepare(decode_chat_request(json.dumps(body).encode()))


def rendered(chat: ChatService, prepared) -> str:
    tokenizers = chat._tokenizers
    return tokenizers.decode(prepared.model, list(prepared.params.prompt_token_ids))


def test_developer_turns_render_as_the_system_turn_of_a_template_without_one(chat) -> None:
    developer = prepare(chat, messages=[{"role": "developer", "content": "Be brief."}, USER])
    system = prepare(chat, messages=[{"role": "system", "content": "Be brief."}, USER])
    assert developer.params.prompt_token_ids == system.params.prompt_token_ids
    named = prepare(chat, messages=[{**USER, "name": "alice"}])
    assert named.params.prompt_token_ids == prepare(chat).params.prompt_token_ids


def test_tools_are_shown_in_the_system_turn_of_a_template_without_tools(chat) -> None:
    prepared = prepare(chat, tools=[WEATHER, TIME])
    text = rendered(chat, prepared)
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert '"name": "get_weather"' in text
    assert "<tool_call>" in text
    assert prepared.params.options.constraint is None  # auto: the model may answer in text
    assert prepared.tool_calls == ToolCallParsing(
        "<tool_call>\n", "\n</tool_call>", frozenset({"get_weather", "get_time"})
    )
    assert prepare(chat, tools=[WEATHER], tool_choice="none").tool_calls is None


def test_required_and_named_calls_are_constrained_to_parse(chat) -> None:
    required = prepare(
        chat, tools=[WEATHER, TIME], tool_choice="required"
    ).params.options.constraint
    assert required is not None
    assert (required.kind, required.begin, required.end) == (
        "tagged_json",
        "<tool_call>\n",
        "\n</tool_call>",
    )
    schema = json.loads(required.schema)
    assert [s["properties"]["name"]["const"] for s in schema["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    assert (required.min_items, required.max_items) == (1, 0)
    single = prepare(
        chat, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    ).params.options.constraint
    assert single is not None
    assert single.max_items == 1
    named = prepare(
        chat,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    ).params.options.constraint
    assert named is not None
    assert json.loads(named.schema)["properties"]["name"] == {"const": "get_time"}
    assert named.max_items == 1


def test_a_tool_round_trip_renders_calls_and_results(chat) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    text = rendered(chat, prepare(chat, tools=[WEATHER], messages=messages))
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call><|im_end|>'
    ) in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    native = prepare(chat, model="native", tools=[WEATHER], messages=messages)
    assert rendered(chat, native) == (
        "<tools>get_weather;</tools>[user]Weather in Paris?[assistant]<call get_weather "
        '{"city": "Paris"}>[tool]18 C, sunny[assistant]'
    )


def test_response_formats_become_constraints(chat) -> None:
    assert prepare(chat, response_format={"type": "text"}).params.options.constraint is None
    obj = prepare(chat, response_format={"type": "json_object"}).params.options.constraint
    assert obj is not None
    assert obj.kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    spec = prepare(chat, response_format=fmt).params.options.constraint
    assert spec is not None
    # strict: the schema's objects closed, as OpenAI reads a strict schema.
    closed = {**schema, "additionalProperties": False}
    assert (spec.kind, json.loads(spec.schema)) == ("json_schema", closed)
    loose = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
    spec = prepare(chat, response_format=loose).params.options.constraint
    assert spec is not None
    assert json.loads(spec.schema) == schema


PARSING = ToolCallParsing("<tool_call>\n", "\n</tool_call>", frozenset({"f"}))


def test_answers_split_into_content_and_calls() -> None:
    content, calls = split_answer(
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        PARSING,
    )
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("f", {"x": 1})]
    assert content == 'Sure.\n\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    only, calls = split_answer('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', PARSING)
    assert only is None
    assert len(calls) == 1
    assert split_answer("no calls", PARSING) == ("no calls", [])


def test_streamed_answers_hold_back_what_may_begin_a_call() -> None:
    scanner = ToolCallScanner(PARSING)
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"y": [1, 2]}}\n</tool_call> bye <tool'
    parts = [part for i in range(0, len(text), 3) for part in scanner.feed(text[i : i + 3])]
    contents = "".join(p for p in parts if isinstance(p, str))
    assert contents == "Hi  bye "
    assert [json.loads(c.function.arguments) for c in scanner.calls] == [{"y": [1, 2]}]
    assert scanner.flush() == ["<tool"]


LEGACY_WEATHER = WEATHER["function"]


def test_legacy_functions_are_tools_answered_in_the_legacy_shape(chat) -> None:
    named = prepare(chat, functions=[LEGACY_WEATHER], function_call={"name": "get_weather"})
    as_tools = prepare(
        chat,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert named.params.prompt_token_ids == as_tools.params.prompt_token_ids
    assert named.params.options.constraint == as_tools.params.options.constraint
    assert named.tool_calls is not None
    assert (named.tool_calls.forced, named.tool_calls.legacy_functions) == (True, True)
    auto = prepare(chat, functions=[LEGACY_WEATHER])
    assert auto.params.options.constraint is None
    assert auto.tool_calls is not None
    assert (auto.tool_calls.forced, auto.tool_calls.legacy_functions) == (False, True)
    assert prepare(chat, functions=[LEGACY_WEATHER], function_call="none").tool_calls is None


def test_a_legacy_round_trip_renders_as_a_tool_round_trip(chat) -> None:
    arguments = '{"city": "Paris"}'
    legacy = [
        USER,
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": arguments}},
        {"role": "function", "name": "get_weather", "content": "18 C, sunny"},
    ]  # fmt: skip
    current = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]  # fmt: skip
    for model in ("m", "native"):
        old = prepare(chat, model=model, functions=[LEGACY_WEATHER], messages=legacy)
        new = prepare(chat, model=model, tools=[WEATHER], messages=current)
        assert rendered(chat, old) == rendered(chat, new)
