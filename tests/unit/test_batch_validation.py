"""Batch submission: every item is validated as /v1/completions would. A malformed batch (or
item JSON) rejects the whole batch with an error naming it, before anything is written; an
item its endpoint refuses is stored failed with that endpoint's error, as OpenAI does (that
line's entry in the error file)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from fedllm_contract.request_options import Priority
from gateway.api.body import decode_body
from gateway.api.openai_errors import OpenAIError, http_status, to_openai
from gateway.batches.items import Entry, inline_entries
from gateway.batches.request import (
    BatchCreateRequest,
    completion_request,
    decode_item,
    item_body,
)
from gateway.batches.service import BatchService
from gateway.chat.service import ChatService
from gateway.chat.templates import ChatTemplates
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import GatewayError
from gateway.federation import ModelConfig
from gateway.files.service import FileService
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import BatchSettings, GatewaySettings, LimitsSettings
from gateway.sites.registry import SiteRegistry
from gateway.stores.file_store import FileStore
from gateway.stores.request_log import RequestLog
from gateway.tenancy.admission import Tenancy
from gateway.tenancy.key_limits import LocalKeyLimits
from gateway.tenancy.keys import KeyService
from gateway.tokenize_pool import TokenizePool
from gateway.tokenizers import ModelTokenizers

GOOD = {"custom_id": "a", "prompt": "hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def service(gpt2_tokenizer_dir: Path) -> BatchService:
    settings = GatewaySettings(
        federation_file=Path("unused.json"),
        batches=BatchSettings(max_items=3),
        limits=LimitsSettings(max_body_bytes=1024),
    )
    # Nothing may be written for a rejected batch: the database has no tables, so any write
    # would fail with a database error instead of the OpenAI error the tests expect.
    sessions = create_sessionmaker(create_engine("sqlite+aiosqlite://"))
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    registry = SiteRegistry([])
    completions = CompletionService(
        settings, registry, tokenizers, build_policy("mico"), RequestLog(sessions)
    )
    chat = ChatService(ChatTemplates({}), tokenizers, completions)
    pool = TokenizePool(1)
    files = FileService(settings, FileStore(sessions), pool)
    tenancy = Tenancy(KeyService(sessions), LocalKeyLimits(), require_keys=False)
    return BatchService.build(
        settings,
        sessions,
        completions,
        chat,
        registry,
        files,
        pool,
        status_of=http_status,
        tenancy=tenancy,
    )


def submit(service: BatchService, body: dict[str, object]) -> OpenAIError:
    request = decode_body(json.dumps(body).encode(), BatchCreateRequest)
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        asyncio.run(service.submit(request, None))
    return to_openai(caught.value)


def batch(*items: dict[str, object], **extra: object) -> dict[str, object]:
    return {"model": "m", "requests": list(items), **extra}


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        (batch(), 400, "requests", "at least one request"),
        (
            batch(*({**GOOD, "custom_id": str(i)} for i in range(4))),
            400,
            "requests",
            "this batch has 4 requests; this gateway takes at most 3",
        ),
        (
            batch(GOOD, {**GOOD, "custom_id": "b"}, GOOD),
            400,
            "requests[2].custom_id",
            "custom_id 'a' is also the custom_id of requests[0]",
        ),
        ({**batch(GOOD), "model": "nope"}, 404, "model", "The model 'nope' does not exist"),
        (
            batch(GOOD, metadata={str(i): "v" for i in range(17)}),
            400,
            "metadata",
            "at most 16 pairs",
        ),
        (batch(GOOD, metadata={"k": "v" * 513}), 400, "metadata", "values at most 512"),
    ],
    ids=[
        "empty",
        "too large",
        "duplicate custom_id",
        "unknown model",
        "metadata pairs",
        "metadata value",
    ],
)
def test_bad_batches_are_rejected_whole(service, body, status, param, message) -> None:
    error = submit(service, body)
    assert (error.status, error.body.param) == (status, param)
    assert message in error.body.message


REFUSED_ITEMS: list[tuple[dict[str, object], str, str]] = [
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ({"n": 99}, "n", "n must be between 1 and 8"),
    ({"stop": ["1", "2", "3", "4", "5"]}, "stop", "stop takes up to 4"),
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"prompt": [1, 99999999]}, "prompt", "token ids must be in"),
    ({"max_tokens": 5000}, "max_tokens", "maximum context length"),
]


def entries(*items: dict[str, object]) -> list[Entry]:
    request = decode_body(json.dumps(batch(*items)).encode(), BatchCreateRequest)
    return inline_entries(request.requests or [], 1 << 20)


def test_items_their_endpoint_refuses_are_stored_failed_with_its_error(service) -> None:
    bad = [
        {**GOOD, **fields, "custom_id": str(i)} for i, (fields, _, _) in enumerate(REFUSED_ITEMS)
    ]
    # A registry without sites knows no context: the last case needs one (tested end to end).
    items = service._preparer.validate("/v1/completions", "m", entries(*bad[:-1]))
    for item, (_, param, message) in zip(items, REFUSED_ITEMS, strict=False):
        assert item.error is not None
        assert (item.status_code, item.error["param"]) == (400, param)
        assert message in str(item.error["message"])
        assert item.prompt_tokens == item.max_tokens == 0
    (good,) = service._preparer.validate("/v1/completions", "m", entries({**GOOD, "n": 2}))
    assert good.error is None
    assert good.max_tokens == 8  # n answers of max_tokens each, for admission and planning


def test_batch_items_run_in_the_batch_priority_class(service) -> None:
    body = {"prompt": "hello", "max_tokens": 4}
    prepared = service._preparer.prepare("/v1/completions", "m", body)
    assert prepared.params.options.priority == Priority.BATCH


def test_a_valid_batch_without_a_healthy_site_is_a_retryable_error(service) -> None:
    error = submit(service, batch(GOOD, {**GOOD, "custom_id": "b"}))
    assert (error.status, error.retry_after_s) == (503, 1)
    assert error.body.message == "no site can serve model 'm' now"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (batch({"prompt": "x"}), "requests[0]", "missing required field `custom_id`"),
        (batch(GOOD, {**GOOD, "stream": True}), "requests[1]", "unknown field `stream`"),
        (batch({**GOOD, "temperature": 9}), "requests[0]", "<= 2.0 - at `$.temperature`"),
        (batch({**GOOD, "custom_id": ""}), "requests[0]", "length >= 1 - at `$.custom_id`"),
        (
            batch({**GOOD, "prompt": "x" * 2000}),
            "requests[0]",
            "a request takes at most 1024 bytes (the body limit of /v1/completions)",
        ),
    ],
)
def test_malformed_items_are_named(service, body, param, message) -> None:
    error = submit(service, body)
    assert (error.status, error.body.param) == (400, param)
    assert message in error.body.message


def test_stored_item_is_the_completion_request_it_stands_for() -> None:
    raw = {"custom_id": "x", "prompt": [1, 2, 3], "max_tokens": 5, "seed": 7, "ignore_eos": True}
    request = decode_body(json.dumps(batch(raw)).encode(), BatchCreateRequest)
    assert request.requests is not None
    body = item_body(decode_item("requests[0]", request.requests[0], 1 << 20))
    # Only what the client set, less custom_id: a 100k-item batch stores no defaults.
    assert body == {"prompt": [1, 2, 3], "max_tokens": 5, "seed": 7, "ignore_eos": True}
    completion = completion_request("m", json.loads(json.dumps(body)))
    assert (completion.model, completion.prompt, completion.max_tokens) == ("m", [1, 2, 3], 5)
    assert (completion.seed, completion.ignore_eos, completion.temperature) == (7, True, 1.0)
    with pytest.raises((OpenAIError, GatewayError)) as caught:
        completion_request("m", {"prompt": "x", "max_tokens": "five"})
    assert to_openai(caught.value).status == 400
    assert msgspec.json.decode(msgspec.json.encode(to_openai(caught.value).envelope()))["error"][
        "message"
    ]
