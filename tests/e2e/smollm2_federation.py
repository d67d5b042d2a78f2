"""A federation serving the real instruct model: two sites running SmolLM2-135M-Instruct from
its GGUF file and a gateway rendering chats with the template inside that file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from devtools.launch import ManagedProcess, free_port, spawn_site, start_gateway
from devtools.launch import wait_until_serving as wait_serving
from tests.e2e.conftest import SITE_PLACES

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class RealFederation:
    base_url: str
    database: Path  # the gateway's SQLite file


def _openai_entry(port: int) -> dict[str, object]:
    """A site of kind `openai`: a site engine reached through its OpenAI-compatible HTTP face."""
    base = f"http://127.0.0.1:{port}"
    return {"kind": "openai", "base_url": f"{base}/v1", "engine_model": MODEL,
            "metrics_url": f"{base}/metrics", "metrics_dialect": "vllm",
            "metrics_interval_ms": 500}  # fmt: skip


@contextmanager
def smollm2_federation(
    smollm2_gguf: Path,
    smollm2_dir: Path,
    work: Path,
    gateway_env: dict[str, str] | None = None,
    openai_site: bool = False,
) -> Iterator[RealFederation]:
    """`openai_site`: the second site is of kind `openai` (the engine's HTTP face) instead of
    gRPC; `gateway_env` adds to the gateway's environment."""
    # The sites find the converted directory that the smollm2_dir fixture made (same cache).
    env = {"FEDLLM_MODEL_CACHE": str(smollm2_dir.parent)}
    names = ["aws-use1", "gcp-euw4"]
    http_port = free_port()
    sites = [
        spawn_site(
            model_dir=smollm2_gguf, site_name=name, model_name=MODEL, log_dir=work, env=env,
            extra_args=["--http-port", str(http_port)] if openai_site and i == 1 else [],
        )
        for i, name in enumerate(names)
    ]  # fmt: skip
    processes: list[ManagedProcess] = list(sites)
    try:
        for site in sites:
            wait_serving(site, timeout_s=180)
        federation = work / "federation.json"
        entries = [
            {
                "name": name,
                "cloud": SITE_PLACES[name][0],
                "region": SITE_PLACES[name][1],
                "model": MODEL,
                **(
                    _openai_entry(http_port) if openai_site and i == 1 else
                    {"endpoint": f"127.0.0.1:{site.port}"}
                ),
            }
            for i, (name, site) in enumerate(zip(names, sites, strict=True))
        ]  # fmt: skip
        models = [{"name": MODEL, "tokenizer": str(smollm2_dir)}]
        federation.write_text(json.dumps({"models": models, "sites": entries}))
        database = work / "gateway.db"
        gateway = start_gateway(
            federation_file=federation,
            database_url=f"sqlite+aiosqlite:///{database}",
            log_dir=work,
            expect_healthy_sites=2,
            env={"GATEWAY_ROUTING_POLICY": "mico", **(gateway_env or {})},
        )
        processes.append(gateway)
        yield RealFederation(f"http://127.0.0.1:{gateway.port}", database)
    finally:
        for process in reversed(processes):
            process.stop()
