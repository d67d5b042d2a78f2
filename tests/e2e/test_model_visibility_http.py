"""Issue 67, through a real gateway on a real PostgreSQL database and a real site serving the
tiny model with LoRA adapters, over HTTP with real clients (the openai SDK, httpx):

- the reversed existence oracle: `/v1/completions` with 65 prompts, and `/v1/responses` with too
  much metadata, a `service_tier`, `background` or a `previous_response_id`, gave a model that
  does not exist 400 but another key's adapter 404. Now the model is resolved for the caller's
  key first, on every endpoint that takes one (completions, chat, responses, embeddings,
  batches, fine-tuning, /v1/models): another key's adapter is answered exactly as an unknown
  name (status and body, but for the name);
- the federation file's adapters are owned by key id: `owner_key_id`, or `owner_key` (a name)
  standing for the oldest live key of that name; a second live key of that name is refused at
  creation (it got 201 and could use them);
- the admin API's two 5xx are 4xx: `owner_key_id` 2^70 (was 500) and a NUL in an adapter's path
  (was 503), with nothing registered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from devtools.launch import ManagedProcess, start_gateway, stop_all, wait_until_serving
from gateway.db.migrate import upgrade
from gateway.db.session import create_engine, create_sessionmaker
from gateway.tenancy.keys import KeyService
from site_engine.engine.lora.adapter import BaseShapes
from tests.support.lora_site import spawn_lora_site, write_federation
from tests.unit.engine.test_lora_adapters import write_adapter

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ADMIN = "admin-token-for-the-model-visibility-tests"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
UNKNOWN = "no-such-ft"
# A: loaded through the admin API for key A (by id); B: the federation file's, by key id;
# C: the federation file's, by key name.
LOADED, BY_ID, BY_NAME = "loaded-ft", "file-id-ft", "file-name-ft"


@dataclass
class Federation:
    gateway: ManagedProcess
    keys: dict[str, tuple[int, str]]  # label -> (id, key)
    uploads: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin/api{path}", headers=ADMIN_HEADERS,
                             timeout=60, **kwargs)  # fmt: skip

    def call(self, who: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[who][1]}"}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kwargs)

    def sdk(self, who: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[who][1], max_retries=0)

    def make_key(self, label: str, name: str) -> httpx.Response:
        made = self.admin("POST", "/keys", json={"name": name})
        if made.status_code == 201:
            self.keys[label] = (made.json()["id"], made.json()["key"])
        return made


async def _keys(database_url: str) -> dict[str, tuple[int, str]]:
    """Keys made before the gateway starts, so that the federation file can name one by id."""
    engine = create_engine(database_url)
    try:
        keys = KeyService(create_sessionmaker(engine))
        made = {label: await keys.create(name, None, None)
                for label, name in (("a", "tenant-a"), ("b", "tenant-b"))}  # fmt: skip
        return {label: (new.record.id, new.plaintext) for label, new in made.items()}
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def federation(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, postgres_url: str
) -> Iterator[Federation]:
    from gateway.db.migrate import downgrade

    work = tmp_path_factory.mktemp("visibility")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    base, targets = BaseShapes.of_model(model), ("q_proj", "v_proj")
    write_adapter(work / "lora" / BY_ID, base, targets=targets, seed=1)
    write_adapter(work / "lora" / BY_NAME, base, targets=targets, seed=2)
    write_adapter(work / "uploads" / LOADED, base, targets=targets, seed=3)
    started: list[ManagedProcess] = []
    try:
        site = spawn_lora_site(tiny_llama_dir, work, max_loras=2)
        started.append(site)
        upgrade(postgres_url)
        keys = asyncio.run(_keys(postgres_url))
        wait_until_serving(site)
        adapters: list[dict[str, Any]] = [
            {"name": BY_ID, "parent": "tiny", "owner_key_id": keys["a"][0]},
            {"name": BY_NAME, "parent": "tiny", "owner_key": "tenant-a"},
        ]
        env = {"GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN}
        gateway = start_gateway(
            federation_file=write_federation(work, tiny_llama_dir, site, adapters),
            database_url=postgres_url,
            log_dir=work,
            env=env,
        )
        started.append(gateway)
        made = Federation(gateway, keys, work / "uploads")
        load = {"name": LOADED, "parent": "tiny", "path": str(made.uploads / LOADED),
                "owner_key_id": keys["a"][0]}  # fmt: skip
        loaded = made.admin("POST", "/adapters", json=load)
        assert loaded.status_code == 201, loaded.text
        yield made
    finally:
        stop_all(list(reversed(started)))
        downgrade(postgres_url)  # the session's database, clean for the next module


def _same_as_unknown(private: httpx.Response, unknown: httpx.Response, model: str) -> int:
    assert private.status_code == unknown.status_code, (private.text, unknown.text)
    assert private.text == unknown.text.replace(UNKNOWN, model)
    return private.status_code


def _sdk_error(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


def test_another_keys_adapter_is_an_unknown_model_through_the_openai_sdk(
    federation: Federation,
) -> None:
    """The issue's cases: 65 prompts on /v1/completions; too much metadata, a service tier,
    background or a previous response on /v1/responses."""
    client = federation.sdk("b")
    prompts = ["The visibility test begins"] * 65
    responses = (
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"service_tier": "priority"},
        {"background": True},
        {"previous_response_id": "resp_0123456789abcdef0123456789abcdef"},
    )
    for model in (LOADED, BY_ID, BY_NAME):
        private = _sdk_error(lambda m=model: client.completions.create(
            model=m, prompt=prompts, max_tokens=2))  # fmt: skip
        unknown = _sdk_error(lambda: client.completions.create(
            model=UNKNOWN, prompt=prompts, max_tokens=2))  # fmt: skip
        assert (private.status_code, unknown.status_code) == (404, 404)
        assert private.response.text == unknown.response.text.replace(UNKNOWN, model)
        for extra in responses:
            private = _sdk_error(lambda m=model, e=extra: client.responses.create(
                model=m, input="hello", **e))  # fmt: skip
            unknown = _sdk_error(lambda e=extra: client.responses.create(
                model=UNKNOWN, input="hello", **e))  # fmt: skip
            assert (private.status_code, unknown.status_code) == (404, 404), extra
            assert private.response.text == unknown.response.text.replace(UNKNOWN, model)
    # The owner's own requests are validated as they were: the model came first for B only.
    owner = federation.sdk("a")
    refused = _sdk_error(lambda: owner.completions.create(
        model=LOADED, prompt=prompts, max_tokens=2))  # fmt: skip
    assert refused.status_code == 400
    refused = _sdk_error(lambda: owner.responses.create(
        model=BY_ID, input="hello", service_tier="priority"))  # fmt: skip
    assert refused.status_code == 400


def test_every_endpoint_taking_a_model_resolves_it_first(federation: Federation) -> None:
    bad_item = {"custom_id": "x", "method": "POST", "url": "/v1/completions",
                "body": {"model": "m", "prompt": "hi", "n": 99}}  # fmt: skip

    def probes(model: str) -> list[tuple[str, str, dict[str, Any] | None]]:
        item = {**bad_item, "body": {**bad_item["body"], "model": model}}  # type: ignore[dict-item]
        return [
            ("POST", "/v1/completions", {"model": model, "prompt": "hi", "n": 99}),
            ("POST", "/v1/completions", {"model": model, "prompt": ["hi"] * 65}),
            ("POST", "/v1/chat/completions",
             {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": 999}),
            ("POST", "/v1/chat/completions", {"model": model, "messages": []}),
            ("POST", "/v1/responses", {"model": model, "input": "hi", "truncation": "auto"}),
            ("POST", "/v1/embeddings", {"model": model, "input": "hi", "dimensions": 0}),
            ("POST", "/v1/batches", {"model": model, "requests": [item],
                                     "endpoint": "/v1/completions", "completion_window": "24h"}),
            ("POST", "/v1/fine_tuning/jobs", {"model": model, "training_file": "file-nope"}),
            ("GET", f"/v1/models/{model}", None),
        ]  # fmt: skip

    for model in (LOADED, BY_ID, BY_NAME):
        for (method, path, body), (_, unknown_path, unknown_body) in zip(
            probes(model), probes(UNKNOWN), strict=True
        ):
            private = federation.call("b", method, path, json=body)
            unknown = federation.call("b", method, unknown_path, json=unknown_body)
            status = _same_as_unknown(private, unknown, model)
            assert status in (400, 404), (path, body, private.text)
    # The owner sees and uses all three.
    listed = {m["id"] for m in federation.call("a", "GET", "/v1/models").json()["data"]}
    assert {LOADED, BY_ID, BY_NAME} <= listed
    for model in (LOADED, BY_ID, BY_NAME):
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        answer = federation.call("a", "POST", "/v1/completions", json=body)
        assert answer.status_code == 200, answer.text


def test_the_federation_files_adapters_belong_to_one_key_id(federation: Federation) -> None:
    # A second live key of the owner's name is refused: it would not get the adapters.
    clash = federation.make_key("a-again", "tenant-a")
    assert clash.status_code == 409, clash.text
    assert clash.json()["error"]["code"] == "key_name_taken"
    assert "a-again" not in federation.keys
    # Once A is revoked, a key of that name may be made again (re-issued), and the name's
    # adapter is the new key's; the adapter given by id stays A's (revoked: no one's).
    revoked = federation.admin("DELETE", f"/keys/{federation.keys['a'][0]}")
    assert revoked.status_code == 200, revoked.text
    again = federation.make_key("a-new", "tenant-a")
    assert again.status_code == 201, again.text
    use = {"prompt": "hi", "max_tokens": 2}
    assert federation.call("a-new", "POST", "/v1/completions",
                           json={"model": BY_NAME, **use}).status_code == 200  # fmt: skip
    by_id = federation.call("a-new", "POST", "/v1/completions", json={"model": BY_ID, **use})
    unknown = federation.call("a-new", "POST", "/v1/completions", json={"model": UNKNOWN, **use})
    _same_as_unknown(by_id, unknown, BY_ID)
    # The first key of a name is its owner; one made after it while it lives is refused.
    assert federation.make_key("other", "tenant-b").status_code == 201  # not an owner's name


def test_an_oversized_owner_id_and_a_nul_in_a_path_are_400(federation: Federation) -> None:
    before = federation.admin("GET", "/keys").json()
    body = {"name": "x-ft", "parent": "tiny", "path": str(federation.uploads / LOADED)}
    for owner in (2**70, 2**31):
        answer = federation.admin("POST", "/adapters", json={**body, "owner_key_id": owner})
        assert answer.status_code == 400, answer.text
    nul = federation.admin("POST", "/adapters", json={**body, "path": f"{body['path']}\u0000x"})
    assert nul.status_code == 400, nul.text
    assert nul.json()["error"]["param"] == "path"
    listed = {m["id"] for m in federation.call("b", "GET", "/v1/models").json()["data"]}
    assert "x-ft" not in listed
    assert federation.admin("GET", "/keys").json() == before
    assert json.dumps(nul.json()).count("x-ft") <= 1  # the name, not a trace of the site
