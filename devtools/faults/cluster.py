"""Real processes to break: site engines, a gateway and its PostgreSQL database.

Every fault here is done to a real thing, the way it happens in production: a site process is
SIGKILLed (and later restarted on the same port), frozen with SIGSTOP (its load reports stop)
and thawed with SIGCONT; the gateway is SIGKILLed and started again on the same database and
port; the gateway's PostgreSQL backends are terminated by the superuser, optionally with new
connections to its database refused for a while.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

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

MODEL = "tiny"
# A stalled (SIGSTOPped) site seen within seconds: two unanswered 1 s health checks in a row;
# one batch item per site at a time and a short lease so a batch is caught half done and
# resumed soon after a gateway dies.
GATEWAY_ENV = {
    "GATEWAY_LOAD_REPORT_STALE_S": "2",
    "GATEWAY_CONNECT_TIMEOUT_S": "1",
    "GATEWAY_HEALTH_FAILURES_TO_DOWN": "2",
    "GATEWAY_BATCH_SITE_CONCURRENCY": "1",
    "GATEWAY_BATCH_LEASE_S": "2",
}
_PLACES = (("aws", "us-east-1"), ("gcp", "europe-west4"), ("azure", "japaneast"))


@dataclass
class Cluster:
    """Sites on fixed ports named in one federation file, a gateway on a fixed port."""

    model_dir: Path
    work: Path
    database_url: str
    site_names: tuple[str, ...] = ("site-a", "site-b")
    gateway_env: Mapping[str, str] = field(default_factory=dict)
    sites: dict[str, ManagedProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    gateway: ManagedProcess | None = None
    gateway_port: int = field(default_factory=free_port)
    gateway_starts: int = 0
    stopped: set[str] = field(default_factory=set)  # sites under SIGSTOP

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    # -- sites -----------------------------------------------------------------------------

    def start(self) -> Cluster:
        self.work.mkdir(parents=True, exist_ok=True)
        self.ports = {name: free_port() for name in self.site_names}
        spawned = [self._spawn_site(name) for name in self.site_names]
        for process in spawned:  # spawned together: the model loads overlap
            wait_until_serving(process)
        self.start_gateway()
        return self

    def _spawn_site(self, name: str) -> ManagedProcess:
        process = spawn_site(
            model_dir=self.model_dir,
            site_name=name,
            model_name=MODEL,
            log_dir=self.work,
            port=self.ports[name],
            extra_args=["--log-level", "WARNING"],
        )
        self.sites[name] = process
        return process

    def kill_site(self, name: str) -> None:
        """SIGKILL: no goodbye to the gateway, streams cut where they are."""
        self.thaw(name)
        self.sites[name].kill()

    def restart_site(self, name: str) -> None:
        """A killed site comes back on the same endpoint (what a supervisor does)."""
        wait_until_serving(self._spawn_site(name))

    def freeze(self, name: str) -> None:
        """SIGSTOP: the process stays, its connections stay open, but nothing answers."""
        os.kill(self.sites[name].popen.pid, signal.SIGSTOP)
        self.stopped.add(name)

    def thaw(self, name: str) -> None:
        if name in self.stopped and self.sites[name].alive():
            os.kill(self.sites[name].popen.pid, signal.SIGCONT)
        self.stopped.discard(name)

    # -- gateway ---------------------------------------------------------------------------

    def federation_file(self) -> Path:
        path = self.work / "federation.json"
        sites = [
            {
                "name": name,
                "cloud": _PLACES[i % len(_PLACES)][0],
                "region": _PLACES[i % len(_PLACES)][1],
                "endpoint": f"127.0.0.1:{self.ports[name]}",
                "model": MODEL,
            }
            for i, name in enumerate(self.site_names)
        ]
        models = [{"name": MODEL, "tokenizer": str(self.model_dir)}]
        path.write_text(json.dumps({"models": models, "sites": sites}))
        return path

    def start_gateway(self) -> ManagedProcess:
        self.gateway_starts += 1
        log_dir = self.work / f"gateway-{self.gateway_starts}"
        live = sum(1 for name, p in self.sites.items() if p.alive() and name not in self.stopped)
        self.gateway = start_gateway(
            federation_file=self.federation_file(),
            database_url=self.database_url,
            log_dir=log_dir,
            port=self.gateway_port,
            env={"GATEWAY_LOG_LEVEL": "WARNING", **self.gateway_env},
            expect_healthy_sites=live,
        )
        return self.gateway

    def kill_gateway(self) -> None:
        assert self.gateway is not None
        self.gateway.kill()

    def readiness(self) -> dict[str, bool]:
        assert self.gateway is not None
        body = readiness(self.gateway, timeout_s=5)
        return {str(k): bool(v) for k, v in body["sites"].items()}

    def wait_site_health(self, name: str, healthy: bool, timeout_s: float = 30.0) -> float:
        """Waits until the gateway reports the site's health as `healthy`; returns when it did
        (time.monotonic() as the answer came: from then on the gateway routes by it)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            try:
                if self.readiness().get(name) is healthy:
                    return time.monotonic()
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway never saw {name} as {'healthy' if healthy else 'unhealthy'}")

    # -- database --------------------------------------------------------------------------

    def query(self, sql: str, **params: object) -> list[tuple[object, ...]]:
        engine = create_engine(sync_url(self.database_url))
        try:
            with engine.connect() as connection:
                return [tuple(row) for row in connection.execute(text(sql), params)]
        finally:
            engine.dispose()

    def _admin_dsn(self) -> tuple[str, str]:
        """A libpq DSN to the server's `postgres` database, and the gateway's database name."""
        url = make_url(self.database_url)
        if url.get_backend_name() != "postgresql":
            raise RuntimeError("database faults need the gateway on PostgreSQL")
        admin = url.set(drivername="postgresql", database="postgres")
        return admin.render_as_string(hide_password=False), str(url.database)

    def drop_database_connections(self, block_s: float = 0.0) -> int:
        """Terminates every backend on the gateway's database (its pooled connections); with
        `block_s`, the database refuses new connections for that long first. Returns how many
        backends were terminated."""
        dsn, database = self._admin_dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            if block_s > 0:
                conn.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS false')
            try:
                row = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (database,),
                ).fetchone()
                if block_s > 0:
                    time.sleep(block_s)
            finally:
                if block_s > 0:
                    conn.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS true')
        return int(row[0]) if row else 0

    # -- teardown --------------------------------------------------------------------------

    def stop(self) -> None:
        for name in list(self.stopped):
            self.thaw(name)
        gateway = [self.gateway] if self.gateway is not None else []
        stop_all([*gateway, *self.sites.values()])
