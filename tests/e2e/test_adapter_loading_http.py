"""LoRA adapters loaded and unloaded at run time through the gateway's admin API (issue 51), with
a real site process started with an empty --lora-dir and a real gateway, the official openai
client as the tenants: a loaded adapter is a model at once (private to its owner key), answers
as itself, and after its unload is the 404 of an unknown model; one that does not fit the base
is refused with OpenAI's error envelope and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from devtools.launch import ManagedProcess, start_gateway, stop_all, wait_until_serving
from site_engine.engine.lora.adapter import BaseShapes
from tests.e2e.conftest import Federation
from tests.support.lora_site import spawn_lora_site, write_federation
from tests.unit.engine.test_lora_adapters import write_adapter

pytestmark = pytest.mark.slow

ADMIN = "admin-token-for-the-adapter-loading-tests"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = "The adapter loading test begins with"


@pytest.fixture(scope="module")
def uploads(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapters on the site's machine, outside its adapter directory."""
    root = tmp_path_factory.mktemp("uploads")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    base, targets = BaseShapes.of_model(model), ("q_proj", "v_proj", "o_proj", "up_proj")
    write_adapter(root / "late-ft", base, targets=targets)
    write_adapter(root / "too-big", base, rank=16, targets=targets)  # the site takes rank <= 8
    return root


@pytest.fixture(scope="module")
def federation(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Federation]:
    work = tmp_path_factory.mktemp("adapter-loading")
    site = spawn_lora_site(tiny_llama_dir, work, max_loras=2)
    started: list[ManagedProcess] = [site]
    try:
        wait_until_serving(site)
        federation_file = write_federation(work, tiny_llama_dir, site)
        url = f"sqlite+aiosqlite:///{work / 'gateway.db'}"
        env = {"GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN}
        gateway = start_gateway(
            federation_file=federation_file, database_url=url, log_dir=work, env=env
        )
        started.append(gateway)
        yield Federation(gateway, {"aws-use1": site}, url)
    finally:
        stop_all(list(reversed(started)))


@pytest.fixture(scope="module")
def clients(federation: Federation) -> Iterator[dict[str, openai.OpenAI]]:
    made = {}
    for who in ("tenant-a", "tenant-b"):
        response = httpx.post(
            f"{federation.base_url}/admin/api/keys",
            json={"name": who},
            headers=ADMIN_HEADERS,
            timeout=30,
        )
        assert response.status_code == 201, response.text
        made[who] = openai.OpenAI(
            base_url=f"{federation.base_url}/v1",
            api_key=response.json()["key"],
            max_retries=0,
            timeout=60,
        )
    yield made
    for client in made.values():
        client.close()


def _admin(federation: Federation, method: str, path: str, **kwargs: object) -> httpx.Response:
    url = f"{federation.base_url}/admin/api/adapters{path}"
    return httpx.request(method, url, headers=ADMIN_HEADERS, timeout=60, **kwargs)  # type: ignore[arg-type]


def _models(client: openai.OpenAI) -> dict[str, str | None]:
    return {m.id: m.model_dump().get("parent") for m in client.models.list()}


def _answer(client: openai.OpenAI, model: str) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert response.model == model
    return response.choices[0].text


def test_only_an_operator_loads_adapters(federation: Federation, uploads: Path) -> None:
    body = {"name": "late-ft", "path": str(uploads / "late-ft"), "parent": "tiny"}
    refused = httpx.post(f"{federation.base_url}/admin/api/adapters", json=body, timeout=30)
    assert refused.status_code in (401, 403)


def test_an_adapter_loaded_at_run_time_is_a_model_until_unloaded(
    federation: Federation, clients: dict[str, openai.OpenAI], uploads: Path
) -> None:
    owner, other = clients["tenant-a"], clients["tenant-b"]
    assert _models(owner) == {"tiny": None}
    body = {"name": "late-ft", "path": str(uploads / "late-ft"), "parent": "tiny",
            "owner_key": "tenant-a"}  # fmt: skip
    loaded = _admin(federation, "POST", "", json=body)
    assert loaded.status_code == 201, loaded.text
    assert loaded.json()["sites"] == [{"site": "aws-use1", "ok": True}]
    assert _models(owner) == {"tiny": None, "late-ft": "tiny"}  # at once, no health check
    assert _models(other) == {"tiny": None}  # private to its owner key
    assert _answer(owner, "late-ft") != _answer(owner, "tiny")
    with pytest.raises(openai.NotFoundError):
        _answer(other, "late-ft")

    again = _admin(federation, "POST", "", json=body)
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "adapter_exists"

    unloaded = _admin(federation, "DELETE", "/late-ft")
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.json()["sites"] == [{"site": "aws-use1", "ok": True}]
    assert _models(owner) == {"tiny": None}
    with pytest.raises(openai.NotFoundError):
        _answer(owner, "late-ft")
    gone = _admin(federation, "DELETE", "/late-ft")
    assert gone.status_code == 404, gone.text
    assert gone.json()["error"]["code"] == "adapter_not_found"


def test_an_adapter_that_does_not_fit_is_refused_and_nothing_changes(
    federation: Federation, clients: dict[str, openai.OpenAI], uploads: Path
) -> None:
    before = _models(clients["tenant-a"])
    body = {"name": "too-big", "path": str(uploads / "too-big"), "parent": "tiny"}
    refused = _admin(federation, "POST", "", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_adapter")
    assert "rank" in error["message"]
    unknown = _admin(federation, "POST", "", json={**body, "parent": "nope"})
    assert unknown.status_code == 400, unknown.text
    assert _models(clients["tenant-a"]) == before
