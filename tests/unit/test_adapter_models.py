"""LoRA adapters as the gateway's models (issue 51): what a request's `model` resolves to, which
sites routing keeps for an adapter, whose private adapter a key may use, and the federation
file's `adapters` section."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.api.body import decode_body
from gateway.api.chat_schemas import decode_chat_request
from gateway.api.completion_schemas import CompletionRequest
from gateway.chat.service import ChatService
from gateway.chat.templates import CHATML_TEMPLATE, ChatTemplate, ChatTemplates
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import GatewayError
from gateway.federation import FederationConfigError, ModelConfig, SiteConfig, parse_federation
from gateway.federation_adapters import AdapterConfig
from gateway.model_catalogue import AdapterCatalogue, ServedAdapter
from gateway.request_path.service import CompletionService
from gateway.routing.filters import ServesModelFilter
from gateway.routing.policy import build_policy
from gateway.routing.types import RoutingRequest
from gateway.settings import GatewaySettings
from gateway.sites.interface import SiteInfoView
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.adapter_owners import Ownership
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers
from tests.unit.routing.sites import Site
from tests.unit.test_site_lease import ScriptedSite

_NEVER_CALLED = ScriptedSite("never", [], dies=False)


def _site(name: str, model: str, adapters: tuple[str, ...], healthy: bool = True) -> SiteState:
    info = SiteInfoView(name, model, 1024, 50257, "f", "cpu", "float32", 16, 256, 8, "e", "v")
    config = SiteConfig(name, "aws", "r", "127.0.0.1:1", model)
    state = SiteState(config, ord(name[0]), _NEVER_CALLED, healthy=healthy)
    state.info = replace(info, adapters=adapters)
    return state


def _registry() -> SiteRegistry:
    return SiteRegistry(
        [
            _site("a", "m", ("tenant-a", "shared")),
            _site("b", "m", ("shared",)),
            _site("c", "other", ("other-ft",)),
            _site("d", "m", ("down-only",), healthy=False),
        ]
    )


def test_an_adapter_a_healthy_site_lists_resolves_to_its_sites_base() -> None:
    catalogue = AdapterCatalogue(_registry())
    assert catalogue.find("shared") == ServedAdapter("shared", "m")
    assert catalogue.find("other-ft") == ServedAdapter("other-ft", "other")
    assert catalogue.find("down-only") is None  # only an unhealthy site lists it
    assert catalogue.find("nobody-serves-this") is None
    # Served, but declared by no one: no one's (issue 58), with a key or without.
    assert catalogue.served(None, None) == []
    assert catalogue.served(1, "key-a") == []
    public = (AdapterConfig("shared", "m"), AdapterConfig("other-ft", "other"))
    catalogue = AdapterCatalogue(_registry(), public)
    assert [a.name for a in catalogue.served(None, None)] == ["other-ft", "shared"]


def test_a_private_adapter_is_its_owners_only_and_a_declared_parent_binds() -> None:
    declared = (
        AdapterConfig("tenant-a", "m", owner_key="key-a"),
        AdapterConfig("other-ft", "m"),  # the file says m; only a site of `other` lists it
    )
    catalogue = AdapterCatalogue(_registry(), (*declared, AdapterConfig("shared", "m")))
    assert catalogue.may_use("tenant-a", 1, "key-a")  # the file names owners by key name
    assert not catalogue.may_use("tenant-a", 2, "key-b")
    assert not catalogue.may_use("tenant-a", None, None)
    assert catalogue.may_use("shared", None, None)  # in the file without an owner: every key's
    assert [a.name for a in catalogue.served(2, "key-b")] == ["shared"]
    assert [a.name for a in catalogue.served(1, "key-a")] == ["shared", "tenant-a"]
    assert catalogue.find("other-ft") is None


def test_an_owner_loaded_at_run_time_is_a_key_id_never_a_name() -> None:
    """Owners written at run time (the admin API, fine-tuning jobs) name a key by id: a second
    key of the same name does not inherit its adapters (issue 58 LOW 3)."""
    model = "ft:m:support:abc123"
    registry = SiteRegistry([_site("a", "m", ("tenant-a", "shared", "keyless", model))])
    catalogue = AdapterCatalogue(registry)
    assert not any(catalogue.may_use(model, key, "acme") for key in (None, 1, 2))
    owners = (
        Ownership("tenant-a", "m", key_id=1),
        Ownership("shared", "m", public=True),
        Ownership("keyless", "m", key_id=None),  # made without a key
        Ownership(model, "m", key_id=1),
    )
    for owner in owners:
        asyncio.run(catalogue.declare(owner))
    assert catalogue.may_use("tenant-a", 1, "acme")
    assert not catalogue.may_use("tenant-a", 2, "acme")  # another key of the same name
    assert not catalogue.may_use("tenant-a", None, None)
    assert all(catalogue.may_use("shared", key, name) for key, name in ((1, "a"), (None, None)))
    assert catalogue.may_use("keyless", None, None)
    assert not catalogue.may_use("keyless", 1, "acme")
    assert [a.name for a in catalogue.served(1, "acme")] == [model, "shared", "tenant-a"]
    asyncio.run(catalogue.forget("tenant-a"))
    assert not catalogue.may_use("tenant-a", 1, "acme")  # unloaded: undeclared again


def test_routing_keeps_only_the_base_sites_that_list_the_adapter() -> None:
    sites = [
        Site("a", adapters=frozenset({"x", "y"})),
        Site("b", adapters=frozenset({"y"})),
        Site("c"),
        Site("d", model="other", adapters=frozenset({"x"})),
    ]
    keep = ServesModelFilter()

    def kept(adapter: str | None) -> list[str]:
        request = RoutingRequest(model="m", prompt_tokens=1, max_tokens=1, adapter=adapter)
        return [s.name for s in keep(request, sites)]

    assert kept(None) == ["a", "b", "c"]
    assert kept("x") == ["a"]
    assert kept("y") == ["a", "b"]
    assert kept("z") == []


def test_an_adapters_blocks_are_hashed_apart_from_the_bases() -> None:
    base = RoutingRequest(model="m", prompt_tokens=32, max_tokens=1, prompt_token_ids=(1,) * 32)
    tuned = RoutingRequest(
        model="m", prompt_tokens=32, max_tokens=1, prompt_token_ids=(1,) * 32, adapter="x"
    )
    assert len(base.block_ids(16)) == 2
    assert set(base.block_ids(16)).isdisjoint(tuned.block_ids(16))


@pytest.fixture(scope="module")
def services(gpt2_tokenizer_dir: Path) -> tuple[CompletionService, ChatService]:
    tokenizers = ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))
    unused_log = RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://")))
    registry = _registry()
    completions = CompletionService(
        GatewaySettings(federation_file=Path("unused.json")),
        registry,
        tokenizers,
        build_policy("round_robin"),
        unused_log,
        adapters=AdapterCatalogue(
            registry, (AdapterConfig("tenant-a", "m", "key-a"), AdapterConfig("shared", "m"))
        ),
    )
    templates = ChatTemplates({"m": ChatTemplate.compile(CHATML_TEMPLATE, "default ChatML")})
    return completions, ChatService(templates, tokenizers, completions)


def test_a_request_for_an_adapter_is_prepared_for_its_base_with_the_adapter_in_its_options(
    services: tuple[CompletionService, ChatService],
) -> None:
    completions, chat = services
    body = json.dumps({"model": "shared", "prompt": "Hello", "max_tokens": 4}).encode()
    prepared = completions.prepare(decode_body(body, CompletionRequest))
    assert (prepared.model, prepared.params.options.adapter) == ("m", "shared")
    assert prepared.served_model == "shared"  # what the answer's `model` says
    assert prepared.routing.adapter == "shared"
    messages = [{"role": "user", "content": "Hi"}]
    chat_body = json.dumps({"model": "tenant-a", "messages": messages}).encode()
    prepared = chat.prepare(decode_chat_request(chat_body))
    assert (prepared.model, prepared.params.options.adapter) == ("m", "tenant-a")
    base = completions.prepare(decode_body(body.replace(b'"shared"', b'"m"'), CompletionRequest))
    assert (base.model, base.params.options.adapter, base.served_model) == ("m", None, "m")


def test_an_unknown_model_and_another_keys_adapter_are_the_same_404(
    services: tuple[CompletionService, ChatService],
) -> None:
    completions, _ = services
    with pytest.raises(GatewayError) as unknown:
        completions.prepare(decode_body(b'{"model": "nope", "prompt": "x"}', CompletionRequest))
    prepared = completions.prepare(
        decode_body(b'{"model": "tenant-a", "prompt": "x"}', CompletionRequest)
    )
    completions.preparer.check_owner(prepared, 1, "key-a")  # the owner's: nothing raised
    for key_id, key in ((2, "key-b"), (None, None)):
        with pytest.raises(GatewayError) as private:
            completions.preparer.check_owner(prepared, key_id, key)
        assert type(private.value) is type(unknown.value)  # NotFound: 404
        assert private.value.fields() == {**unknown.value.fields(), "message": _says("tenant-a")}
    assert unknown.value.fields()["message"] == _says("nope")
    # Resolved before anything else of a request (issue 67): a name not served and another
    # key's adapter alike; the owner's adapter and a base pass.
    for model in ("nope", "tenant-a"):
        with pytest.raises(GatewayError) as first:
            completions.preparer.check_model_owner(model, 2, "key-b")
        assert first.value.fields() == {**unknown.value.fields(), "message": _says(model)}
    completions.preparer.check_model_owner("tenant-a", 1, "key-a")
    completions.preparer.check_model_owner("m", 2, "key-b")


def _says(model: str) -> str:
    return f"The model '{model}' does not exist"


GOOD: dict[str, object] = {
    "models": [{"name": "m", "tokenizer": "tok"}, {"name": "e", "tokenizer": "t", "task": "embed"}],
    "sites": [{"name": "a", "cloud": "aws", "region": "r", "endpoint": "h:1", "model": "m"}],
}


def test_the_federation_file_gives_adapters_a_parent_and_an_owner(tmp_path: Path) -> None:
    adapters = [{"name": "ft", "parent": "m", "owner_key": "acme"}, {"name": "pub", "parent": "m"},
                {"name": "by-id", "parent": "m", "owner_key_id": 7}]  # fmt: skip
    config = parse_federation(json.dumps({**GOOD, "adapters": adapters}).encode(), tmp_path)
    assert config.adapters == (
        AdapterConfig("ft", "m", "acme"),
        AdapterConfig("pub", "m"),
        AdapterConfig("by-id", "m", owner_key_id=7),
    )
    assert parse_federation(json.dumps(GOOD).encode(), tmp_path).adapters == ()


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ([{"name": "ft", "parent": "missing"}], "not a generative model"),
        ([{"name": "ft", "parent": "e"}], "not a generative model"),
        ([{"name": "m", "parent": "m"}], "the name is a model's"),
        ([{"name": "ft", "parent": "m"}, {"name": "ft", "parent": "m"}], "more than once"),
        ([{"name": "ft", "parent": "m", "owner": "acme"}], "unknown field"),
        ([{"name": "ft", "parent": "m", "owner_key": ""}], "owner_key"),
        ([{"name": "bad name", "parent": "m"}], "name"),
        ([{"name": "ft", "parent": "m", "owner_key": "a", "owner_key_id": 1}], "not both"),
        ([{"name": "ft", "parent": "m", "owner_key_id": 2**70}], "owner_key_id"),
        ([{"name": "ft", "parent": "m", "owner_key_id": 0}], "owner_key_id"),
    ],
)
def test_adapter_entries_are_checked_loudly(adapters: object, message: str) -> None:
    with pytest.raises(FederationConfigError, match=message):
        parse_federation(json.dumps({**GOOD, "adapters": adapters}).encode(), Path("."))
