"""Adapter-aware routing with two real CPU site processes and a real gateway (issue 51): the sites
report where their LoRA adapters are (device slot, host memory) in their load reports, the
gateway's overview shows it, and under equal load an adapter's requests go to the site that
holds it (the completion_cost profile; the scorer's order and its weight against load are
unit-tested in tests/unit/routing/test_adapter_affinity.py). An adapter loaded at run time
starts on disk everywhere, sits in a slot where its first request went, and leaves every report
once unloaded."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from devtools.launch import ManagedProcess, start_gateway, stop_all, wait_until_serving
from site_engine.engine.lora.adapter import BaseShapes
from tests.e2e.conftest import Federation
from tests.support.lora_site import spawn_lora_site, write_sites_federation
from tests.unit.engine.test_lora_adapters import write_adapter

pytestmark = pytest.mark.slow

ADMIN = "admin-token-for-the-adapter-routing-tests"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
SITES = ("site-a", "site-b")
TARGETS = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapter-routing")


@pytest.fixture(scope="module")
def federation(tiny_llama_dir: Path, work: Path) -> Iterator[Federation]:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    base = BaseShapes.of_model(model)
    for site in SITES:  # both sites serve ft-1 and ft-2; "late" comes at run time
        for seed, name in enumerate(("ft-1", "ft-2")):
            write_adapter(work / f"lora-{site}" / name, base, targets=TARGETS, seed=seed)
    write_adapter(work / "uploads" / "late", base, targets=TARGETS, seed=7)
    started: list[ManagedProcess] = []
    try:
        sites = {}
        for site in SITES:
            sites[site] = spawn_lora_site(
                tiny_llama_dir, work, max_loras=1, site_name=site, lora=f"lora-{site}"
            )
            started.append(sites[site])
        for process in sites.values():
            wait_until_serving(process)
        # The sites' own adapters, every key's (one no one declares is no one's: issue 58).
        public = [{"name": name, "parent": "tiny"} for name in ("ft-1", "ft-2")]
        federation_file = write_sites_federation(work, tiny_llama_dir, sites, public)
        url = f"sqlite+aiosqlite:///{work / 'gateway.db'}"
        env = {"GATEWAY_ADMIN_TOKEN": ADMIN, "GATEWAY_ROUTING_POLICY": "completion_cost"}
        gateway = start_gateway(
            federation_file=federation_file, database_url=url, log_dir=work, env=env,
            expect_healthy_sites=2,
        )  # fmt: skip
        started.append(gateway)
        yield Federation(gateway, sites, url)
    finally:
        stop_all(list(reversed(started)))


def _complete(federation: Federation, model: str) -> str:
    """One short greedy completion; the site that served it."""
    body = {"model": model, "prompt": "Adapters go where", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{federation.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.headers["X-Fedllm-Site"]


def _residency(federation: Federation) -> dict[str, dict[str, Any]]:
    response = httpx.get(
        f"{federation.base_url}/admin/api/overview", headers=ADMIN_HEADERS, timeout=30
    )
    assert response.status_code == 200, response.text
    return {
        site["name"]: {"device": site["adapters_on_device"], "host": site["adapters_in_host"]}
        for site in response.json()["sites"]
    }


def _wait_for(federation: Federation, check: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        seen = _residency(federation)
        if check(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"the residency never matched; last seen {seen}")
        time.sleep(0.3)


def test_an_adapters_requests_go_where_it_is_resident(federation: Federation) -> None:
    first = _complete(federation, "ft-1")
    other = next(site for site in SITES if site != first)
    seen = _wait_for(federation, lambda r: "ft-1" in r[first]["device"])
    assert "ft-1" not in seen[other]["device"] + seen[other]["host"]
    # Idle sites, one at a time: equal load, and only `first` holds the adapter.
    assert [_complete(federation, "ft-1") for _ in range(6)] == [first] * 6


def test_residency_follows_load_and_unload(federation: Federation, work: Path) -> None:
    body = {"name": "late", "path": str(work / "uploads" / "late"), "parent": "tiny"}
    url = f"{federation.base_url}/admin/api/adapters"
    loaded = httpx.post(url, json=body, headers=ADMIN_HEADERS, timeout=60)
    assert loaded.status_code == 201, loaded.text
    on_disk = _residency(federation)
    assert all("late" not in r["device"] + r["host"] for r in on_disk.values())
    served_by = _complete(federation, "late")
    _wait_for(federation, lambda r: "late" in r[served_by]["device"])
    unloaded = httpx.delete(f"{url}/late", headers=ADMIN_HEADERS, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    _wait_for(federation, lambda r: all("late" not in s["device"] + s["host"] for s in r.values()))
