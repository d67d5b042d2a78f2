"""The Responses API at the gateway, without sites: a request becomes the very prompt and
constraint the equivalent chat request makes; what is not served is refused naming the
Responses API's own parameter; an answer's text becomes the same output items whole or
streamed; and every object and event validates against the openai SDK's own models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from fedllm_contract.request_options import Priority
from gateway.api.chat_schemas import decode_chat_request
from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.api.responses_schemas import decode_response_request
from gateway.batch_settings import ResponseSettings
from gateway.chat.service import ChatService
from gateway.chat.templates import CHATML_TEMPLATE, ChatTemplate, ChatTemplates
from gateway.completions.result import PromptTokensDetails, Usage
from gateway.db.session import create_engine, create_sessionmaker
from gateway.dispatch.request import PreparedCompletion, ToolCallParsing
from gateway.errors import GatewayError, invalid_request
from gateway.federation import ModelConfig
from gateway.request_path.service import CompletionService
from gateway.responses.items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    MessageItem,
    OutputText,
    input_items,
)
from gateway.responses.output import OutputBuilder
from gateway.responses.result import ResponseObject, finished
from gateway.responses.service import ResponsePlan, ResponsesService
from gateway.responses.to_chat import ParamMap
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.request_log import RequestLog
from gateway.stores.response_store import ResponseStore
from gateway.tokenizers import ModelTokenizers

TOOL = {"type": "function", "name": "get_weather", "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}  # fmt: skip
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
HERMES = ToolCallParsing("<tool_call>\n", "\n</tool_call>", frozenset({"get_weather"}))
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def services(gpt2_tokenizer_dir: Path) -> tuple[ChatService, ResponsesService]:
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    settings = GatewaySettings(federation_file=Path("unused.json"))
    # prepare() must not touch the database: the stores point at one that is never created.
    sessions = create_sessionmaker(create_engine("sqlite+aiosqlite://"))
    completions = CompletionService(
        settings, SiteRegistry([]), tokenizers, build_policy("round_robin"), RequestLog(sessions)
    )
    templates = ChatTemplates({"m": ChatTemplate.compile(CHATML_TEMPLATE, "default ChatML")})
    chat = ChatService(templates, tokenizers, completions)
    return chat, ResponsesService(chat, ResponseStore(sessions), ResponseSettings())


def respond(services: tuple[ChatService, ResponsesService], **fields: Any) -> ResponsePlan:
    body = json.dumps({"model": "m", "input": "Hello", **fields}).encode()
    return services[1].prepare(decode_response_request(body), earlier=[], owner=None)


def chat(services: tuple[ChatService, ResponsesService], **fields: Any) -> PreparedCompletion:
    body = json.dumps({"model": "m", **fields}).encode()
    return services[0].prepare(decode_chat_request(body))


def test_input_and_instructions_make_the_chat_prompt(services) -> None:
    plan = respond(services, input="Hello", instructions="Be brief.", max_output_tokens=5)
    same = chat(
        services,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_completion_tokens=5,
    )
    prepared = plan.prepared
    assert prepared.params.prompt_token_ids == same.params.prompt_token_ids
    assert prepared.params.max_tokens == 5
    assert prepared.request_id.startswith("resp_")
    assert prepared.api == "responses"
    assert plan.draft.id == prepared.request_id
    assert plan.draft.status == "in_progress"


def test_a_function_call_and_its_output_make_chat_tool_turns(services) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]  # fmt: skip
    plan = respond(services, input=items, tools=[TOOL], tool_choice="auto")
    same = chat(
        services,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        ],
        tools=[CHAT_TOOL],
        tool_choice="auto",
    )  # fmt: skip
    assert plan.prepared.params.prompt_token_ids == same.params.prompt_token_ids
    assert plan.prepared.tool_calls == same.tool_calls
    assert [item.id for item in plan.input_items][1:3] == ["msg_1", "fc_1"]


@pytest.mark.parametrize(
    ("tier", "priority"),
    [("auto", Priority.INTERACTIVE), ("default", Priority.INTERACTIVE), ("flex", Priority.FLEX)],
)
def test_the_flex_tier_is_served_as_the_flex_priority_class(services, tier, priority) -> None:
    plan = respond(services, service_tier=tier)
    assert plan.prepared.params.options.priority == priority
    assert plan.draft.service_tier == ("flex" if tier == "flex" else "default")


def test_text_format_and_tool_choice_make_chat_constraints(services) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    plan = respond(services, text={"format": {"type": "json_schema", "name": "x",
                                              "schema": schema, "strict": True}})  # fmt: skip
    same = chat(
        services,
        messages=[{"role": "user", "content": "Hello"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        },
    )
    assert plan.prepared.params.options.constraint == same.params.options.constraint
    assert plan.draft.text["format"]["name"] == "x"
    named = respond(services, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    same = chat(
        services,
        messages=[{"role": "user", "content": "Hello"}],
        tools=[CHAT_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert named.prepared.params.options.constraint == same.params.options.constraint
    assert named.prepared.params.options.constraint is not None
    json_object = respond(services, text={"format": {"type": "json_object"}})
    assert json_object.prepared.params.options.constraint is not None
    assert json_object.prepared.params.options.constraint.kind == "json_object"  # fmt: skip


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"tools": [{**TOOL, "parameters": {"type": "array", "uniqueItems": True}}]},
     "tools[0].parameters"),
    ({"tools": [{**TOOL, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"service_tier": "scale"}, "service_tier"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
     "text.format.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input[0].arguments"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"input": ["Hello"]}, "input"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_refused_naming_the_responses_parameter(services, fields, param) -> None:
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        respond(services, **fields)
    error = to_openai(caught.value)
    assert error.status == 400, error.body
    assert error.body.param == param, error.body


@pytest.mark.parametrize(
    ("chat_param", "param"),
    [
        ("messages[1].content", "input[0]"),
        ("messages[2].tool_calls[0].function", "input[3]"),
        ("messages[0]", "instructions"),
        ("messages", "input"),
        ("tools[1].function.parameters", "tools[1].parameters"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("response_format.type", "text.format.type"),
        ("max_completion_tokens", "max_output_tokens"),
        ("temperature", "temperature"),
    ],
)
def test_chat_s_parameters_become_the_caller_s(chat_param: str, param: str) -> None:
    where = ParamMap(["instructions", "input[0]", "input[2]"], {(2, 0): "input[3]"})
    error = where.renamed(invalid_request(f"{chat_param}: wrong", param=chat_param))
    assert (error.param, error.message) == (param, f"{param}: wrong")


def run(builder: OutputBuilder, pieces: list[str], reason: str = "stop") -> list[Any]:
    events = [event for piece in pieces for event in builder.feed(piece)]
    return events + builder.finish(reason)


def as_sdk(events: list[Any]) -> list[Any]:
    """Each event through the openai SDK's own discriminated union (validated)."""
    return [
        EVENTS.validate_python({**msgspec.to_builtins(event), "sequence_number": i})
        for i, event in enumerate(events)
    ]


ANSWER = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call>\n"
)


@pytest.mark.parametrize("size", [1, 3, 7, len(ANSWER)])
def test_streamed_and_whole_answers_make_the_same_items(size: int) -> None:
    whole = OutputBuilder(HERMES)
    run(whole, [ANSWER])
    streamed = OutputBuilder(HERMES)
    pieces = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
    events = as_sdk(run(streamed, pieces))
    strip = [msgspec.structs.replace(i, id="x", call_id="c") if isinstance(i, FunctionCallItem)
             else msgspec.structs.replace(i, id="x") for i in streamed.items]  # fmt: skip
    same = [msgspec.structs.replace(i, id="x", call_id="c") if isinstance(i, FunctionCallItem)
            else msgspec.structs.replace(i, id="x") for i in whole.items]  # fmt: skip
    assert strip == same
    assert [type(item) for item in streamed.items] == [MessageItem, FunctionCallItem]
    assert streamed.items[0].text == "Checking.\n"  # type: ignore[union-attr]
    kinds = [event.type for event in events]
    assert kinds[0:2] == ["response.output_item.added", "response.content_part.added"]
    begun = len(kinds) - 1 - kinds[::-1].index("response.output_item.added")
    arguments = kinds[begun + 1 : -2]
    assert set(arguments) == {"response.function_call_arguments.delta"}
    # The arguments go out as they are written: piece by piece when the text comes so.
    assert len(arguments) > 1 if size < 10 else len(arguments) == 1
    assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(fragments) == '{"city": "Paris"}'
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Checking.\n"
    call = streamed.items[1]
    assert isinstance(call, FunctionCallItem)
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")


def test_space_between_calls_opens_no_message() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>'
    builder = OutputBuilder(HERMES)
    run(builder, [call, "\n", call, "\n"])
    assert [type(item) for item in builder.items] == [FunctionCallItem, FunctionCallItem]


def test_an_empty_or_cut_answer() -> None:
    empty = OutputBuilder(None)
    as_sdk(run(empty, [""]))
    (message,) = empty.items
    assert isinstance(message, MessageItem)
    assert (message.text, message.status) == ("", "completed")
    cut = OutputBuilder(None)
    as_sdk(run(cut, ["Once upon", " a time"], reason="length"))
    assert cut.items[0].status == "incomplete"


def test_the_response_object_validates_against_the_sdk(services) -> None:
    plan = respond(services, tools=[TOOL], metadata={"k": "v"}, instructions="Be brief.")
    builder = OutputBuilder(HERMES)
    run(builder, [ANSWER])
    usage = Usage(10, 4, 14, PromptTokensDetails(cached_tokens=8))
    response = finished(plan.draft, builder.items, "stop", usage)
    sdk = Response.model_validate(msgspec.to_builtins(response))
    assert sdk.status == "completed"
    assert sdk.output_text == "Checking.\n"
    assert sdk.usage is not None
    assert sdk.usage.input_tokens_details.cached_tokens == 8
    assert sdk.tools[0].type == "function"
    assert sdk.metadata == {"k": "v"}
    stored = msgspec.convert(msgspec.to_builtins(response), ResponseObject)
    assert stored == response
    cut = finished(plan.draft, builder.items, "length", usage)
    assert Response.model_validate(msgspec.to_builtins(cut)).incomplete_details is not None


def test_items_keep_what_a_follow_up_sends_back() -> None:
    items = input_items([
        {"role": "developer", "content": "Be terse."},
        {"role": "assistant", "content": "Earlier answer", "phase": "final_answer"},
        {"type": "function_call_output", "call_id": "c",
         "output": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ])  # fmt: skip
    assert [item.id[:4] for item in items] == ["msg_", "msg_", "fco_"]
    assert isinstance(items[1], MessageItem)
    assert isinstance(items[1].content[0], OutputText)
    assert isinstance(items[2], FunctionCallOutputItem)
    assert items[2].output == "a\nb"
    first = input_items("Hi")[0]
    assert isinstance(first, MessageItem)
    assert isinstance(first.content[0], InputText)
