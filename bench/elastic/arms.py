"""The three arms, each on fresh processes (no arm inherits another's caches): static 1 site,
static 2 sites, and autoscaled 1-2 sites, whose gateway's local actuator starts the second site
on the second place (GPU) when its scaling controller asks for it, and stops it after draining.

Every arm's gateway has the same settings (routing policy, offload on: a site that joins takes
queued work from the busy one at once, as in a static federation).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.elastic.presets import ElasticPreset, Place
from bench.loadgen.workload import ROUTED_MODEL
from devtools.launch import ManagedProcess, spawn_site, start_gateway, stop_all, wait_until_serving

ARMS = ("autoscaled", "static1", "static2")
ADMIN_TOKEN = "elastic-bench-admin-credential"
POLICY = "least_latency"
# Named after this process: the timeline finds a site's process by its name (/proc), and another
# benchmark on the same machine may run a "site-1" of its own.
_TAG = f"b{os.getpid()}"
SITE_NAMES = (f"{_TAG}-site-1", f"{_TAG}-site-2")
ELASTIC_PREFIX = f"{_TAG}-elastic"  # the autoscaled arm's second site is <prefix>-0
ELASTIC_SITE = f"{ELASTIC_PREFIX}-0"


def site_args(place: Place) -> list[str]:
    return ["--model-name", ROUTED_MODEL, *place.args]


@dataclass
class ArmProcesses:
    arm: str
    gateway: ManagedProcess
    sites: dict[str, ManagedProcess]
    database_url: str
    # The site names the timeline watches for: the static ones, and the elastic one.
    watched: tuple[str, ...]
    started: list[ManagedProcess] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def close(self) -> None:
        stop_all([self.gateway, *self.sites.values()], timeout_s=60)


def scaling_document(preset: ElasticPreset, model_dir: Path, log_dir: Path) -> dict[str, object]:
    place = preset.places[1]
    command = [sys.executable, "-m", "site_engine", "--model", str(model_dir)]
    return {
        "interval_s": 0.5,
        "drain_timeout_s": 300,
        "models": [
            {
                "model": ROUTED_MODEL,
                "min_sites": 1,
                "max_sites": 2,
                **dict(preset.rule),
                "actuator": {
                    "kind": "local",
                    "name_prefix": ELASTIC_PREFIX,
                    "command": command,
                    "slots": [{"env": dict(place.env), "args": site_args(place)}],
                    "log_dir": str(log_dir),
                    "start_timeout_s": preset.site_start_timeout_s,
                    "pool_size": preset.pool_size,
                },
            }
        ],
    }


def start_arm(
    arm: str,
    preset: ElasticPreset,
    model_dir: Path,
    tokenizer_dir: Path,
    work_dir: Path,
    predictor_dir: Path | None = None,
) -> ArmProcesses:
    folder = work_dir / arm
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("gateway.db*"):
        stale.unlink()
    count = 2 if arm == "static2" else 1
    spawned = [
        spawn_site(
            model_dir=model_dir, site_name=SITE_NAMES[i], model_name=ROUTED_MODEL,
            log_dir=folder, extra_args=preset.places[i].args, env=dict(preset.places[i].env),
        )
        for i in range(count)
    ]  # fmt: skip
    try:
        sites = {p.name: wait_until_serving(p, preset.site_start_timeout_s) for p in spawned}
        federation = {
            "models": [{"name": ROUTED_MODEL, "tokenizer": str(tokenizer_dir)}],
            "sites": [
                {"name": name, "cloud": "local", "region": f"gpu-{i}", "model": ROUTED_MODEL,
                 "endpoint": f"127.0.0.1:{p.port}"}
                for i, (name, p) in enumerate(sites.items())
            ],
        }  # fmt: skip
        (folder / "federation.json").write_text(json.dumps(federation, indent=2))
        env = {
            "GATEWAY_ROUTING_POLICY": POLICY,
            "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
            "GATEWAY_LOAD_REPORT_INTERVAL_MS": "100",
            "GATEWAY_SITE_MAX_QUEUED_REQUESTS": "0",
            "GATEWAY_MAX_IN_FLIGHT": "1000000",
            "GATEWAY_REQUEST_TIMEOUT_S": "3600",
            "GATEWAY_COLLECT_SAMPLES": "false",
            "GATEWAY_OFFLOAD_ENABLED": "true",
            "GATEWAY_OFFLOAD_INTERVAL_S": "0.25",
            **({"GATEWAY_PREDICTOR_DIR": str(predictor_dir)} if predictor_dir else {}),
        }
        watched = tuple(sites)
        if arm == "autoscaled":
            scaling = scaling_document(preset, model_dir, folder / "elastic-logs")
            (folder / "scaling.json").write_text(json.dumps(scaling, indent=2))
            env["GATEWAY_SCALING_FILE"] = str(folder / "scaling.json")
            watched = (*watched, ELASTIC_SITE)
        database_url = f"sqlite+aiosqlite:///{folder / 'gateway.db'}"
        gateway = start_gateway(
            federation_file=folder / "federation.json", database_url=database_url,
            log_dir=folder, env=env, expect_healthy_sites=len(sites), timeout_s=300,
        )  # fmt: skip
    except BaseException:
        stop_all(spawned)
        raise
    return ArmProcesses(arm, gateway, sites, database_url, watched)
