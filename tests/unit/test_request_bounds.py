"""Bounds on what one request may ask for, beyond the body size: stop strings and chat turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.api.body import decode_body
from gateway.api.chat_schemas import MAX_MESSAGES, decode_chat_request
from gateway.api.completion_schemas import CompletionRequest
from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.completions.sampling_options import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import GatewayError
from gateway.federation import ModelConfig
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers
from site_engine import grpc_server


@pytest.fixture(scope="module")
def service(gpt2_tokenizer_dir: Path) -> CompletionService:
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    settings = GatewaySettings(federation_file=Path("unused.json"))
    unused_log = RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://")))
    return CompletionService(
        settings, SiteRegistry([]), tokenizers, build_policy("round_robin"), unused_log
    )


def prepare(service: CompletionService, stop: object) -> object:
    body = json.dumps({"model": "m", "prompt": "hi", "stop": stop}).encode()
    return service.prepare(decode_body(body, CompletionRequest))


@pytest.mark.parametrize(
    "stop",
    [
        ["a"] * (MAX_STOP_SEQUENCES + 1),
        [""],
        "x" * (MAX_STOP_CHARS + 1),
        ["ok", "y" * (MAX_STOP_CHARS + 1)],
    ],
)
def test_stop_strings_are_bounded(service: CompletionService, stop: object) -> None:
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        prepare(service, stop)
    assert (to_openai(caught.value).status, to_openai(caught.value).body.param) == (400, "stop")


def test_stop_strings_within_bounds_pass(service: CompletionService) -> None:
    prepare(service, ["z" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES)


def test_the_gateway_never_sends_stop_strings_the_site_refuses() -> None:
    assert MAX_STOP_SEQUENCES <= grpc_server.MAX_STOP_STRINGS
    assert MAX_STOP_CHARS <= grpc_server.MAX_STOP_CHARS


def _chat(turns: int) -> bytes:
    messages = [{"role": "user", "content": "hi"}] * turns
    return json.dumps({"model": "m", "messages": messages}).encode()


def test_chat_messages_are_bounded() -> None:
    assert len(decode_chat_request(_chat(MAX_MESSAGES)).messages) == MAX_MESSAGES
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        decode_chat_request(_chat(MAX_MESSAGES + 1))
    assert (to_openai(caught.value).status, to_openai(caught.value).body.param) == (400, "messages")
