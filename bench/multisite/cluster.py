"""Real site engines and gateways on this machine, started through devtools.launch.

Sites get fixed ports chosen up front, so one federation file can name every site a benchmark
will ever use: a gateway started early sees a site as unhealthy until its process starts and
routes to it from the next health check on. That lets one pair of gateways serve a growing
number of sites (2, 3, 6, 9) without restarts.

Each site serves one routing "model" name; the benchmark gives the sites of each engine policy
their own name (e.g. `tiny-static`, `tiny-iter`), so one gateway serves both and a request's
`model` field picks the engine policy it is measured on.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devtools.launch import (
    LaunchError,
    ManagedProcess,
    free_port,
    readiness,
    spawn_site,
    start_gateway,
    wait_until_serving,
)

_PLACES = (("aws", "us-east-1"), ("gcp", "europe-west4"), ("azure", "japaneast"))


@dataclass(frozen=True, slots=True)
class SiteSpec:
    name: str
    model: str  # the routing model name this site serves
    policy: str  # the engine's scheduling policy: "fcfs" (iteration-level) or "static"
    max_batch: int
    port: int
    capacity_weight: float = 1.0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


def site_specs(
    model: str, policy: str, count: int, max_batch: int, *, prefix: str | None = None
) -> list[SiteSpec]:
    """`count` equal sites of one model, on free ports."""
    tag = prefix or model
    return [SiteSpec(f"{tag}-{i + 1}", model, policy, max_batch, free_port()) for i in range(count)]


def federation_document(model_dir: Path, specs: Sequence[SiteSpec]) -> dict[str, object]:
    models = sorted({spec.model for spec in specs})
    return {
        "models": [{"name": name, "tokenizer": str(model_dir)} for name in models],
        "sites": [
            {
                "name": spec.name,
                "cloud": _PLACES[i % len(_PLACES)][0],
                "region": _PLACES[i % len(_PLACES)][1],
                "endpoint": spec.endpoint,
                "model": spec.model,
                "capacity_weight": spec.capacity_weight,
            }
            for i, spec in enumerate(specs)
        ],
    }


@dataclass
class Gateway:
    name: str
    process: ManagedProcess
    routing_policy: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.process.port}"

    def readiness(self) -> dict[str, object]:
        return readiness(self.process)

    def wait_for_sites(self, names: Iterable[str], timeout_s: float = 60.0) -> None:
        """Until the gateway sees every named site healthy."""
        wanted = set(names)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sites = self.readiness().get("sites", {})
            if isinstance(sites, dict) and all(sites.get(name) for name in wanted):
                return
            time.sleep(0.2)
        raise LaunchError(f"gateway {self.name} never saw {sorted(wanted)} healthy")


@dataclass
class Cluster:
    """Owns every process it starts and stops them all on close()."""

    work_dir: Path
    model_dir: Path
    kv_cache_mib: int
    sites: dict[str, ManagedProcess] = field(default_factory=dict)
    gateways: list[Gateway] = field(default_factory=list)

    def start_sites(self, specs: Sequence[SiteSpec], site_args: Sequence[str] = ()) -> None:
        """Starts them all, then waits: their start-ups (imports, model load) overlap."""
        spawned = []
        for spec in specs:
            if spec.name in self.sites:
                continue
            process = spawn_site(
                model_dir=self.model_dir,
                site_name=spec.name,
                model_name=spec.model,
                log_dir=self.work_dir / "logs",
                port=spec.port,
                extra_args=[
                    "--policy",
                    spec.policy,
                    "--max-num-seqs",
                    str(spec.max_batch),
                    "--kv-cache-mib",
                    str(self.kv_cache_mib),
                    *site_args,
                ],
            )
            self.sites[spec.name] = process
            spawned.append(process)
        for process in spawned:
            wait_until_serving(process)

    def stop_sites(self, names: Iterable[str] | None = None) -> None:
        for name in list(self.sites if names is None else names):
            process = self.sites.pop(name, None)
            if process is not None:
                if process.alive():
                    # A held or throttled site may be stopped (SIGSTOP): it must run to exit.
                    process.popen.send_signal(signal.SIGCONT)
                process.stop()

    def start_gateway(
        self,
        name: str,
        routing_policy: str,
        specs: Sequence[SiteSpec],
        *,
        predictor_dir: Path | None,
        env: Mapping[str, str] | None = None,
        expect_healthy: int = 1,
    ) -> Gateway:
        """A gateway whose federation names all of `specs` (started or not) and a fresh SQLite
        database of its own."""
        folder = self.work_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        federation = folder / "federation.json"
        federation.write_text(json.dumps(federation_document(self.model_dir, specs), indent=2))
        for stale in folder.glob("gateway.db*"):
            stale.unlink()
        settings = {
            "GATEWAY_ROUTING_POLICY": routing_policy,
            "GATEWAY_HEALTH_INTERVAL_S": "1.0",
            # Held sites run a twentieth of the time (hold.py): answering takes a little longer.
            "GATEWAY_CONNECT_TIMEOUT_S": "10",
            # The whole burst waits at the sites, as in MICO's setting: no per-site queue bound
            # and no in-flight cap turn part of it away (the defaults would, past 256 queued
            # per site or 1,024 in flight).
            "GATEWAY_SITE_MAX_QUEUED_REQUESTS": "0",
            "GATEWAY_MAX_IN_FLIGHT": "1000000",
            "GATEWAY_REQUEST_TIMEOUT_S": "3600",
            **({"GATEWAY_PREDICTOR_DIR": str(predictor_dir)} if predictor_dir else {}),
            **(env or {}),
        }
        process = start_gateway(
            federation_file=federation,
            database_url=self.database_url(name),
            log_dir=folder,
            env=settings,
            expect_healthy_sites=expect_healthy,
        )
        gateway = Gateway(name, process, routing_policy)
        self.gateways.append(gateway)
        return gateway

    def database_url(self, gateway_name: str) -> str:
        return f"sqlite+aiosqlite:///{self.work_dir / gateway_name / 'gateway.db'}"

    def stop_gateway(self, gateway: Gateway) -> None:
        gateway.process.stop()
        self.gateways.remove(gateway)

    def close(self) -> None:
        for gateway in list(self.gateways):
            self.stop_gateway(gateway)
        self.stop_sites()
