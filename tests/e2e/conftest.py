"""Real processes on loopback: site engines, a gateway, and helpers to read what it recorded."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from devtools.launch import (
    ManagedProcess,
    free_port,
    readiness,
    spawn_site,
    start_gateway,
    stop_all,
    wait_until_serving,
)
from gateway.db.migrate import sync_url

# The gateway writes its request log behind the answers, every GATEWAY_REQUEST_LOG_FLUSH_MS
# (20 ms): what a test reads right after an answer may be that far behind. A reader waits this
# long (an answer's outcome is queued as its response ends), then until /readyz shows nothing
# queued: on a loaded machine a flush can take far longer than a fixed wait.
WRITE_BEHIND_S = 0.3
WRITTEN_TIMEOUT_S = 30.0


def wait_until_written(base_url: str) -> None:
    """Returns once the gateway's request log has no write left to make (or fails the test).

    A gateway that no longer listens (a test killed it) will write nothing more: returns at once.
    """
    time.sleep(WRITE_BEHIND_S)
    deadline = time.monotonic() + WRITTEN_TIMEOUT_S
    while True:
        try:
            ready = readiness(base_url)
        except httpx.ConnectError:
            return
        queued = ready["request_log"]["queued"]
        if queued == 0:
            return
        assert time.monotonic() < deadline, f"{queued} request log writes still queued"
        time.sleep(0.05)


@dataclass
class Federation:
    gateway: ManagedProcess
    sites: dict[str, ManagedProcess]
    database_url: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def query(self, sql: str) -> list[tuple[object, ...]]:
        wait_until_written(self.base_url)
        engine = create_engine(sync_url(self.database_url))
        try:
            with engine.connect() as connection:
                return [tuple(row) for row in connection.execute(text(sql))]
        finally:
            engine.dispose()

    def rows(self, where: str = "1=1") -> list[dict[str, object]]:
        wait_until_written(self.base_url)
        engine = create_engine(sync_url(self.database_url))
        try:
            with engine.connect() as connection:
                result = connection.execute(
                    text(
                        f"SELECT r.*, s.name AS site_name FROM requests r "
                        f"LEFT JOIN sites s ON s.id = r.site_id WHERE {where}"
                    )
                )
                return [dict(row._mapping) for row in result]
        finally:
            engine.dispose()


SITE_PLACES = {
    "aws-use1": ("aws", "us-east-1"),
    "gcp-euw4": ("gcp", "europe-west4"),
    "azure-jpe": ("azure", "japaneast"),
}


def write_federation(
    path: Path,
    model_dir: Path,
    endpoints: dict[str, str],
    model_options: dict[str, str] | None = None,
) -> Path:
    sites = [
        {
            "name": name,
            "cloud": SITE_PLACES[name][0],
            "region": SITE_PLACES[name][1],
            "endpoint": endpoint,
            "model": "tiny",
        }
        for name, endpoint in endpoints.items()
    ]
    model = {"name": "tiny", "tokenizer": str(model_dir), **(model_options or {})}
    path.write_text(json.dumps({"models": [model], "sites": sites}))
    return path


@pytest.fixture(scope="module")
def start_federation(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Federation]]:
    """Starts live sites (plus configured-but-dead ones) and a gateway; stops them afterwards."""
    started: list[ManagedProcess] = []

    def start(
        live: list[str],
        dead: tuple[str, ...] = (),
        database_url: str | None = None,
        env: dict[str, str] | None = None,
        model_options: dict[str, str] | None = None,
        python: str | None = None,
    ) -> Federation:
        work = tmp_path_factory.mktemp("federation")
        sites = {
            name: spawn_site(
                model_dir=tiny_llama_dir, site_name=name, model_name="tiny", log_dir=work
            )
            for name in live
        }
        started.extend(sites.values())
        for process in sites.values():
            wait_until_serving(process)
        endpoints = {name: f"127.0.0.1:{p.port}" for name, p in sites.items()}
        endpoints.update({name: f"127.0.0.1:{free_port()}" for name in dead})
        url = database_url or f"sqlite+aiosqlite:///{work / 'gateway.db'}"
        gateway = start_gateway(
            federation_file=write_federation(
                work / "federation.json", tiny_llama_dir, endpoints, model_options
            ),
            database_url=url,
            log_dir=work,
            expect_healthy_sites=len(live),
            env=env,
            python=python,
        )
        started.append(gateway)
        return Federation(gateway, sites, url)

    yield start
    stop_all(list(reversed(started)))
