"""Request validation at the gateway: every bad input is a 4xx in the OpenAI shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.api.body import decode_body
from gateway.api.completion_schemas import CompletionRequest
from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import GatewayError
from gateway.federation import ModelConfig
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers


@pytest.fixture(scope="module")
def service(gpt2_tokenizer_dir: Path) -> CompletionService:
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    settings = GatewaySettings(federation_file=Path("unused.json"))
    # prepare() must not touch the database: the log points at a database that is never created.
    unused_log = RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://")))
    return CompletionService(
        settings, SiteRegistry([]), tokenizers, build_policy("round_robin"), unused_log
    )


def prepare(service: CompletionService, **body: object):
    return service.prepare(
        decode_body(json.dumps({"model": "m", **body}).encode(), CompletionRequest)
    )


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        (b"", 400, None, "body is empty"),
        (b"{bad", 400, None, "not valid JSON"),
        (b'{"model": "m", "prompt": "\xff"}', 400, None, "not valid UTF-8"),
        (b"[1, 2]", 400, None, "Expected `object`"),
        (b'{"model": "m"}', 400, "prompt", "missing required field `prompt`"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', 400, "max_tokens", "Expected `int"),
        (b'{"model": "m", "prompt": "x", "temperature": 3}', 400, "temperature", "<= 2"),
        (b'{"model": "m", "prompt": "x", "top_p": 0}', 400, "top_p", "> 0"),
        (b'{"model": "m", "prompt": "x", "tools": []}', 400, None, "unknown field `tools`"),
    ],
)
def test_bad_bodies(body: bytes, status: int, param: str | None, message: str) -> None:
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        decode_body(body, CompletionRequest)
    assert to_openai(caught.value).status == status
    assert to_openai(caught.value).body.param == param
    assert message in to_openai(caught.value).body.message


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": [1, "a"]}, 400, "prompt"),
        ({"prompt": [1, 99999999]}, 400, "prompt"),
        ({"prompt": "x", "n": 99}, 400, "n"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
        ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"12": 101}}, 400, "logit_bias"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": "x", "stop": [""]}, 400, "stop"),
        ({"prompt": "x", "seed": -1}, 400, "seed"),
    ],
)
def test_bad_requests_are_refused_before_anything_happens(service, fields, status, param) -> None:
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        prepare(service, **fields)
    assert (to_openai(caught.value).status, to_openai(caught.value).body.param) == (status, param)


@pytest.mark.parametrize(
    ("prompt", "expected_ids"),
    [
        ("Hello world", [15496, 995]),
        ([15496, 995], [15496, 995]),
        (["Hello world"], [15496, 995]),
        ([[15496, 995]], [15496, 995]),
    ],
)
def test_prompt_forms(service, prompt, expected_ids) -> None:
    prepared = prepare(service, prompt=prompt, max_tokens=3, stop="\n", seed=5)
    assert list(prepared.params.prompt_token_ids) == expected_ids
    assert prepared.params.options.stop == ("\n",)
    assert prepared.params.options.seed == 5
    assert prepared.request_id.startswith("cmpl-")


def test_default_max_tokens_is_openais(service) -> None:
    assert prepare(service, prompt="x").params.max_tokens == 16


def test_stream_obfuscation_is_accepted(service) -> None:
    """OpenAI's SDKs may ask a stream not to pad its events; none is padded here."""
    options = {"include_usage": True, "include_obfuscation": False}
    prepared = prepare(service, prompt="x", stream=True, stream_options=options)
    assert (prepared.stream, prepared.include_usage) == (True, True)
