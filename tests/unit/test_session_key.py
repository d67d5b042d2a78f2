"""The key session affinity follows: session_id, else prompt_cache_key, else user, from
/v1/completions and /v1/chat/completions alike; a key that is not a bounded string is a 400
naming it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from gateway.api.body import decode_body
from gateway.api.chat_schemas import decode_chat_request
from gateway.api.completion_schemas import CompletionRequest
from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.chat.service import ChatService
from gateway.chat.templates import CHATML_TEMPLATE, ChatTemplate, ChatTemplates
from gateway.completions.request import MAX_SESSION_KEY_CHARS
from gateway.db.session import create_engine, create_sessionmaker
from gateway.dispatch.request import PreparedCompletion
from gateway.errors import GatewayError
from gateway.federation import ModelConfig
from gateway.request_path.prepare import Delivery, session_key
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers

ALL = {"session_id": "s", "prompt_cache_key": "p", "user": "u"}


@pytest.mark.parametrize(
    ("given", "key"),
    [
        (ALL, "s"),
        ({"prompt_cache_key": "p", "user": "u"}, "p"),
        ({"session_id": "s", "user": "u"}, "s"),
        ({"user": "u"}, "u"),
        ({}, None),
        ({"session_id": "", "prompt_cache_key": "p"}, "p"),  # empty: not given
        ({"session_id": "", "user": ""}, None),
    ],
)
def test_the_first_given_of_session_id_prompt_cache_key_and_user(
    given: dict[str, str], key: str | None
) -> None:
    delivery = Delivery(
        user=given.get("user"),
        session_id=given.get("session_id"),
        prompt_cache_key=given.get("prompt_cache_key"),
    )
    assert session_key(delivery) == key


@pytest.fixture(scope="module")
def completions(gpt2_tokenizer_dir: Path) -> CompletionService:
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    # prepare() must not touch the database: the log points at a database that is never created.
    unused_log = RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://")))
    return CompletionService(
        GatewaySettings(federation_file=Path("unused.json")),
        SiteRegistry([]),
        tokenizers,
        build_policy("round_robin"),
        unused_log,
    )


@pytest.fixture(scope="module")
def chat(completions: CompletionService, gpt2_tokenizer_dir: Path) -> ChatService:
    templates = ChatTemplates({"m": ChatTemplate.compile(CHATML_TEMPLATE, "default ChatML")})
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    return ChatService(templates, tokenizers, completions)


def _completion(completions: CompletionService, fields: Mapping[str, object]) -> PreparedCompletion:
    body = json.dumps({"model": "m", "prompt": "Hello", **fields}).encode()
    return completions.prepare(decode_body(body, CompletionRequest))


def _chat(chat: ChatService, fields: Mapping[str, object]) -> PreparedCompletion:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], **fields}
    return chat.prepare(decode_chat_request(json.dumps(body).encode()))


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize(
    ("given", "key"), [(ALL, "s"), ({"prompt_cache_key": "p", "user": "u"}, "p"), ({}, None)]
)
def test_routing_follows_the_session_key_of_either_api(
    completions: CompletionService,
    chat: ChatService,
    api: str,
    given: dict[str, str],
    key: str | None,
) -> None:
    prepared = _completion(completions, given) if api == "completions" else _chat(chat, given)
    assert prepared.routing.session_key == key
    assert prepared.user == given.get("user")  # the request log's user is still the user


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("param", ["session_id", "prompt_cache_key"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (42, "Expected `str | null`, got `int`"),
        (["a"], "Expected `str | null`, got `array`"),
        ("x" * (MAX_SESSION_KEY_CHARS + 1), f"length <= {MAX_SESSION_KEY_CHARS}"),
    ],
)
def test_a_session_key_that_is_not_a_bounded_string_is_a_400_naming_it(
    completions: CompletionService,
    chat: ChatService,
    api: str,
    param: str,
    value: object,
    message: str,
) -> None:
    fields: dict[str, object] = {param: value}
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        _completion(completions, fields) if api == "completions" else _chat(chat, fields)
    error = to_openai(caught.value)
    assert (error.status, error.body.param) == (400, param)
    assert message in error.body.message


def test_a_session_key_at_its_bound_is_taken(completions: CompletionService) -> None:
    longest = "x" * MAX_SESSION_KEY_CHARS
    assert _completion(completions, {"session_id": longest}).routing.session_key == longest


def test_a_session_key_is_scoped_to_its_api_key(completions: CompletionService) -> None:
    """Two tenants that pick the same session id share no affinity entry; without a key (an
    open gateway) the client's key is used as sent."""
    prepared = _completion(completions, {"session_id": "chat-1"})
    first = completions.preparer.salted(prepared, 7).routing.session_key
    second = completions.preparer.salted(prepared, 8).routing.session_key
    assert first == "7:chat-1"
    assert second == "8:chat-1"
    assert completions.preparer.salted(prepared, None).routing.session_key == "chat-1"
    anonymous = _completion(completions, {})
    assert completions.preparer.salted(anonymous, 7).routing.session_key is None
