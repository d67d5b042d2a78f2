"""The dashboard's Batches panel in a real headless Chromium, against a real site serving a LoRA
adapter and a real gateway: a batch still running shows its progress and ETA as GET
/admin/api/batches gave them to the page, and the adapter's requests and tokens as GET
/admin/api/adapters counted them from the request rows (the page formats, never computes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from playwright.sync_api import Page
from transformers import AutoModelForCausalLM

from devtools.launch import ManagedProcess, start_gateway, stop_all, wait_until_serving
from site_engine.engine.lora.adapter import BaseShapes
from tests.e2e.batch_client import item, wait_for
from tests.e2e.conftest import Federation, wait_until_written
from tests.support.lora_site import spawn_lora_site, write_federation
from tests.unit.engine.test_lora_adapters import write_adapter

pytestmark = [pytest.mark.browser, pytest.mark.slow]
TOKEN = "browser-test-workload-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}

# Each row's cells: field -> [its text, the raw number where the cell keeps one].
ROWS = """(table) => [...document.querySelectorAll(`${table} tbody tr`)].map((tr) =>
  Object.fromEntries([...tr.querySelectorAll('[data-field]')].map((td) =>
    [td.dataset.field, [td.textContent, td.dataset.value ?? null]])))"""


@pytest.fixture(scope="module")
def federation(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Federation]:
    work = tmp_path_factory.mktemp("workload")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    write_adapter(work / "lora" / "support-ft", BaseShapes.of_model(model), targets=("q_proj",))
    site = spawn_lora_site(tiny_llama_dir, work, max_loras=1)
    started: list[ManagedProcess] = [site]
    try:
        wait_until_serving(site)
        federation_file = write_federation(
            work, tiny_llama_dir, site, [{"name": "support-ft", "parent": "tiny"}]
        )
        url = f"sqlite+aiosqlite:///{work / 'gateway.db'}"
        gateway = start_gateway(
            federation_file=federation_file, database_url=url, log_dir=work,
            env={"GATEWAY_ADMIN_TOKEN": TOKEN},
        )  # fmt: skip
        started.append(gateway)
        yield Federation(gateway, {"aws-use1": site}, url)
    finally:
        stop_all(list(reversed(started)))


def test_batches_panel_shows_progress_and_adapter_load(federation: Federation, page: Page) -> None:
    with httpx.Client(base_url=federation.base_url, timeout=60) as client:
        for i in range(3):
            body = {"model": "support-ft", "prompt": f"adapter call {i}", "max_tokens": 4,
                    "ignore_eos": True}  # fmt: skip
            assert client.post("/v1/completions", json=body).status_code == 200
        body = {"model": "tiny", "prompt": "the base model", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
        wait_until_written(federation.base_url)
        # Long enough to be running while the page loads; cancelled at the end.
        items = [item(f"long-{i}", f"Write about topic {i}", 300) for i in range(64)]
        created = client.post("/v1/batches", json={"model": "tiny", "requests": items})
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        wait_for(client, batch_id, statuses=("in_progress",))
        try:
            page.goto(f"{federation.base_url}/admin/login")
            page.fill("#token", TOKEN)
            # The very answers the page got: what it shows must be them, formatted.
            with (
                page.expect_response(lambda r: "/admin/api/batches" in r.url) as batches_answer,
                page.expect_response(lambda r: "/admin/api/adapters" in r.url) as adapters_answer,
            ):
                page.click("button[type=submit]")
            page.wait_for_selector("html[data-ready=true]", timeout=15_000)
            batches: dict[str, Any] = batches_answer.value.json()
            adapters: dict[str, Any] = adapters_answer.value.json()
            shown_batches = page.evaluate(ROWS, "#batches")
            shown_adapters = page.evaluate(ROWS, "#adapters")
        finally:
            client.post(f"/v1/batches/{batch_id}/cancel")
    # The running batch, with the API's progress and ETA.
    assert [b["id"] for b in batches["data"]] == [batch_id]
    api_batch = batches["data"][0]
    assert api_batch["status"] == "in_progress"
    progress = api_batch["progress"]
    assert progress["planned_tokens"] > 0
    counts = api_batch["request_counts"]
    assert len(shown_batches) == 1
    shown = {field: text for field, (text, _) in shown_batches[0].items()}
    raw = {field: value for field, (_, value) in shown_batches[0].items()}
    assert {k: shown[k] for k in ("id", "model", "status", "requests")} == {
        "id": batch_id,
        "model": "tiny",
        "status": "in_progress",
        "requests": f"{counts['completed'] + counts['failed']} / 64",
    }
    assert float(raw["fraction"]) == progress["fraction"]
    assert shown["fraction"].endswith(f"{100 * progress['fraction']:.1f} %")
    eta = progress["eta_seconds"]
    if eta is None:
        assert (shown["eta"], raw["eta"]) == ("–", "")
    else:
        assert float(raw["eta"]) == eta
    # The adapter's three requests (the base model's one is no adapter's), as counted.
    assert [(a["adapter"], a["model"], a["requests"]) for a in adapters["adapters"]] == [
        ("support-ft", "tiny", 3)
    ]
    assert adapters["adapters"][0]["completion_tokens"] == 12
    assert adapters["adapters"][0]["prompt_tokens"] > 0
    assert [{k: text for k, (text, _) in row.items()} for row in shown_adapters] == [
        {k: str(v) for k, v in row.items()} for row in adapters["adapters"]
    ]
