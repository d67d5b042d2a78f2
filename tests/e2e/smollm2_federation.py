"""A federation serving the real instruct model: two sites running SmolLM2-135M-Instruct from
its GGUF file and a gateway rendering chats with the template inside that file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from devtools.launch import ManagedProcess, spawn_site, start_gateway
from devtools.launch import wait_until_serving as wait_serving
from tests.e2e.conftest import SITE_PLACES

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class RealFederation:
    base_url: str
    database: Path  # the gateway's SQLite file


@contextmanager
def smollm2_federation(
    smollm2_gguf: Path, smollm2_dir: Path, work: Path
) -> Iterator[RealFederation]:
    # The sites find the converted directory that the smollm2_dir fixture made (same cache).
    env = {"FEDLLM_MODEL_CACHE": str(smollm2_dir.parent)}
    names = ["aws-use1", "gcp-euw4"]
    sites = [
        spawn_site(model_dir=smollm2_gguf, site_name=name, model_name=MODEL, log_dir=work, env=env)
        for name in names
    ]
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
                "endpoint": f"127.0.0.1:{site.port}",
                "model": MODEL,
            }
            for name, site in zip(names, sites, strict=True)
        ]
        models = [{"name": MODEL, "tokenizer": str(smollm2_dir)}]
        federation.write_text(json.dumps({"models": models, "sites": entries}))
        database = work / "gateway.db"
        gateway = start_gateway(
            federation_file=federation,
            database_url=f"sqlite+aiosqlite:///{database}",
            log_dir=work,
            expect_healthy_sites=2,
            env={"GATEWAY_ROUTING_POLICY": "mico"},
        )
        processes.append(gateway)
        yield RealFederation(f"http://127.0.0.1:{gateway.port}", database)
    finally:
        for process in reversed(processes):
            process.stop()
