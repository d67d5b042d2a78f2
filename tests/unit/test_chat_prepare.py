"""Chat request validation at the gateway: what is served, what is refused (by name), and that a
chat request becomes the same prepared completion /v1/completions would make of its prompt."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fedllm_contract.request_options import Priority
from gateway.api.body import decode_body
from gateway.api.chat_schemas import decode_chat_request
from gateway.api.completion_schemas import CompletionRequest
from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.chat.service import ChatService
from gateway.chat.templates import CHATML_TEMPLATE, ChatTemplate, ChatTemplates
from gateway.db.session import create_engine, create_sessionmaker
from gateway.dispatch.request import PreparedCompletion
from gateway.errors import GatewayError
from gateway.federation import ModelConfig
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers

USER = {"role": "user", "content": "Hello world"}
STRICT = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
STRICT += "{% endif %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizers(gpt2_tokenizer_dir: Path) -> ModelTokenizers:
    return ModelTokenizers(
        (ModelConfig("m", gpt2_tokenizer_dir), ModelConfig("strict", gpt2_tokenizer_dir))
    )


@pytest.fixture(scope="module")
def completions(tokenizers: ModelTokenizers) -> CompletionService:
    settings = GatewaySettings(federation_file=Path("unused.json"))
    # prepare() must not touch the database: the log points at a database that is never created.
    unused_log = RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://")))
    return CompletionService(
        settings, SiteRegistry([]), tokenizers, build_policy("round_robin"), unused_log
    )


@pytest.fixture(scope="module")
def chat(tokenizers: ModelTokenizers, completions: CompletionService) -> ChatService:
    templates = ChatTemplates(
        {
            "m": ChatTemplate.compile(CHATML_TEMPLATE, "default ChatML"),
            "strict": ChatTemplate.compile(STRICT, "test"),
        }
    )
    return ChatService(templates, tokenizers, completions)


def prepare(chat: ChatService, **fields: object):
    body = {"model": "m", "messages": [USER], **fields}
    return chat.prepare(decode_chat_request(json.dumps(body).encode()))


def refusal(chat: ChatService, **fields: object) -> OpenAIError:
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        prepare(chat, **fields)
    return to_openai(caught.value)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED = [
    # Unknown to OpenAI's API: refused at decoding, by name.
    ({"messages": [{**USER, "cache_control": {}}]}, "messages[0].cache_control"),
    ({"best_of": 2}, "best_of"),
    (
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    # OpenAI's fields with values OpenAI refuses: wrong types, unknown values, past bounds.
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"verbosity": "loud"}, "verbosity"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"prediction": {"type": "file", "content": "x"}}, "prediction"),
    ({"prediction": {"type": "content"}}, "prediction"),
    ({"safety_identifier": "s" * 129}, "safety_identifier"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": "no"}}, "stream_options"),
    ({"modalities": ["text", "video"]}, "modalities"),
    # OpenAI's fields asking for what no model here has: refused unless null / text only.
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    # The legacy functions: checked as tools are, named as the client sent them.
    ({"function_call": "auto"}, "function_call"),
    ({"functions": [{"name": "bad name"}]}, "functions[0].name"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call"),
    ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call"),
    ({"functions": [{"name": "f"}], "tools": [TOOL]}, "functions"),
    ({"functions": [{"name": "f", "parameters": {"type": "nope"}}]}, "functions[0].parameters"),
    # Served, with OpenAI's bounds: a bad value is a 400 naming the parameter.
    ({"n": 99}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 3}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"99999999": -100}}, "logit_bias"),
    ({"logit_bias": {"one": 1}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.json_schema.name",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "foo"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": 5}},
                }
            ]
        },
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    # Messages: roles, parts and fields that are not served, or malformed.
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].name"),
    ({"messages": [{**USER, "tool_calls": []}]}, "messages[0].tool_calls"),
    (
        {"messages": [{**USER, "function_call": {"name": "f", "arguments": "{}"}}]},
        "messages[0].function_call",
    ),
    (
        {"messages": [USER, {"role": "assistant", "tool_calls": [{"x": 1}]}]},
        "messages[1].tool_calls[0]",
    ),
    ({"messages": [{**USER, "refusal": "no"}]}, "messages[0].refusal"),
    ({"messages": [{"role": "assistant", "audio": {"id": "a1"}}]}, "messages[0].audio"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"x": 1}]}]},
        "messages[0].content[1]",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0]",
    ),
    # Shared sampling checks, named by the field the client used.
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"user": "u" * 300}, "user"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_unsupported_parameters_are_refused_by_name(chat, fields, param) -> None:
    error = refusal(chat, **fields)
    assert (error.status, error.body.type, error.body.param) == (
        400,
        "invalid_request_error",
        param,
    )
    assert error.body.message


def test_unknown_model_is_404(chat) -> None:
    error = refusal(chat, model="gpt-17")
    assert (error.status, error.body.param, error.body.code) == (404, "model", "model_not_found")


def test_a_template_refusal_is_a_400_on_messages(chat) -> None:
    error = refusal(chat, model="strict", messages=[{"role": "system", "content": "x"}, USER])
    assert (error.status, error.body.param) == (400, "messages")
    assert "no system" in error.body.message


NEUTRAL = {
    "n": 1,
    "logprobs": False,
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "tool_choice": "none",
    "store": False,
    "service_tier": "auto",
    "modalities": ["text"],
    "temperature": None,
    "top_p": None,
    "stream": None,
}


def test_neutral_values_are_accepted(chat) -> None:
    prepared = prepare(chat, **NEUTRAL)
    params = prepared.params
    assert (params.options.temperature, params.options.top_p, prepared.stream) == (1.0, 1.0, False)


def same_request(a: PreparedCompletion, b: PreparedCompletion) -> bool:
    """The same request to the sites but for its id."""
    return replace(a.params, request_id="") == replace(b.params, request_id="")


# What newer OpenAI clients send that changes no answer here: accepted, and ignored.
IGNORED = {
    "metadata": {f"k{i}": "v" * 512 for i in range(16)},
    "store": True,
    "reasoning_effort": "low",
    "verbosity": "high",
    "prediction": {"type": "content", "content": [{"type": "text", "text": "Hello"}]},
    # "flex" is a priority class (test_the_flex_tier_is_the_flex_priority_class).
    "service_tier": "scale",
    "safety_identifier": "user-1234",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "modalities": ["text"],
    "audio": None,
    "web_search_options": None,
    "moderation": None,
    "parallel_tool_calls": True,
}


@pytest.mark.parametrize("field", sorted(IGNORED))
def test_fields_that_change_no_answer_are_accepted_and_ignored(chat, field) -> None:
    plain = prepare(chat, max_tokens=5)
    lenient = prepare(chat, max_tokens=5, **{field: IGNORED[field]})
    assert same_request(lenient, plain)
    assert lenient.tool_calls is None


@pytest.mark.parametrize(
    ("tier", "priority"),
    [(None, Priority.INTERACTIVE), ("auto", Priority.INTERACTIVE),
     ("default", Priority.INTERACTIVE), ("flex", Priority.FLEX)],
)  # fmt: skip
def test_the_flex_tier_is_the_flex_priority_class(chat, tier, priority) -> None:
    prepared = prepare(chat, max_tokens=5, service_tier=tier)
    assert prepared.params.options.priority == priority
    plain = prepare(chat, max_tokens=5)
    assert replace(prepared.params, request_id="", options=plain.params.options) == replace(
        plain.params, request_id=""
    )


def test_stream_obfuscation_and_cache_breakpoints_are_accepted(chat) -> None:
    plain = prepare(chat, stream=True, stream_options={"include_usage": True})
    options = {"include_usage": True, "include_obfuscation": False}
    part = {"type": "text", "text": "Hello world", "prompt_cache_breakpoint": {"mode": "explicit"}}
    lenient = prepare(
        chat, stream=True, stream_options=options, messages=[{"role": "user", "content": [part]}]
    )
    assert same_request(lenient, plain)
    assert lenient.include_usage


def test_an_assistant_refusal_renders_as_its_text(chat) -> None:
    refused = [USER, {"role": "assistant", "content": None, "refusal": "I cannot."}, USER]
    said = [USER, {"role": "assistant", "content": "I cannot."}, USER]
    assert same_request(prepare(chat, messages=refused), prepare(chat, messages=said))


def test_the_prompt_is_the_rendered_template_tokenized(chat, tokenizers) -> None:
    messages = [{"role": "system", "content": "Be brief."}, USER]
    prepared = prepare(chat, messages=messages, max_tokens=5, stop="\n", seed=3, user="u1")
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert list(prepared.params.prompt_token_ids) == tokenizers.encode("m", rendered)
    assert prepared.params.max_tokens == 5
    assert prepared.params.options.stop == ("\n",)
    assert (prepared.params.options.seed, prepared.user) == (3, "u1")
    assert prepared.request_id.startswith("chatcmpl-")
    assert prepared.api == "chat.completions"
    # The length predictor reads the question, not the template's markup.
    assert prepared.prompt_text == "Hello world"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, 16),  # no site says the context: the gateway default, as for /v1/completions
        ({"max_tokens": 7}, 7),
        ({"max_completion_tokens": 9}, 9),
        ({"max_tokens": 4, "max_completion_tokens": 4}, 4),
    ],
)
def test_both_length_limits_are_honoured(chat, fields, expected) -> None:
    assert prepare(chat, **fields).params.max_tokens == expected


def test_text_parts_are_joined_with_newlines(chat) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    prepared = prepare(chat, messages=[{"role": "user", "content": parts}])
    assert prepared.prompt_text == "first\nsecond"
    same = prepare(chat, messages=[{"role": "user", "content": "first\nsecond"}])
    assert prepared.params.prompt_token_ids == same.params.prompt_token_ids


def test_streaming_and_usage_options(chat) -> None:
    prepared = prepare(chat, stream=True, stream_options={"include_usage": True})
    assert (prepared.stream, prepared.include_usage) == (True, True)
    assert not prepare(chat, stream=True).include_usage


def test_completions_prepare_is_unchanged(completions) -> None:
    body = json.dumps({"model": "m", "prompt": "Hello world", "max_tokens": 3}).encode()
    prepared = completions.prepare(decode_body(body, CompletionRequest))
    assert prepared.api == "completions"
    assert prepared.request_id.startswith("cmpl-")
    assert list(prepared.params.prompt_token_ids) == [15496, 995]
