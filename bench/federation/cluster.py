"""The processes of one federation: site engines, the latency injector in front of them, and one
gateway per compared policy, all real processes started through their command lines
(`python -m site_engine`, `python -m bench.federation.wan`, `python -m gateway`); and, for the
`sglang_router` arm, SGLang's own router (`python -m bench.federation.sglang_arm`, the
`sglang-router` wheel) in front of the sites' OpenAI HTTP faces.

Every gateway names the sites by their injector ports, so all its gRPC (health checks, load
reports, generation) crosses the injected network; SGLang's router reaches the sites' HTTP faces
through the injector too. Gateways are started together once, each with its own SQLite database
and settings, and are measured one at a time; offload is off in every gateway except where a
scenario turns it on (a gateway's offload would release requests that another gateway sent).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.federation.topology import ROUTED_MODEL, Preset, SiteSpec
from devtools.launch import (
    LaunchError,
    ManagedProcess,
    free_port,
    spawn_site,
    start_gateway,
    wait_until_serving,
)
from gateway.routing.catalogue import BUILT_IN
from gateway.routing.profile_settings import PartSettings, ProfileSettings

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
_PLACES = (
    ("aws", "us-east-1"),
    ("gcp", "europe-west4"),
    ("azure", "japaneast"),
    ("aws", "ap-south-1"),
)


@dataclass(frozen=True, slots=True)
class Arm:
    """A compared configuration: a routing policy and what its gateway knows of answer lengths.
    predictor: serve the length predictor (`source`: the base one, or the one adapted from
    served traffic, bench/federation/adapt.py); plan: GATEWAY_PLAN_WITHOUT_PREDICTION. router:
    "gateway" (ours) or "sglang" (SGLang's own router, policy cache_aware; `policy` names it)."""

    name: str
    policy: str
    predictor: bool
    plan: str = "max_tokens"
    note: str = ""
    router: str = "gateway"
    source: str = "base"


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("round_robin", "round_robin", False, note="baseline"),
        Arm("least_requests", "least_requests", False, note="production-stack's default"),
        Arm(
            "least_tokens_guess",
            "least_tokens_guess",
            False,
            "prompt_ratio",
            "least outstanding tokens, the answer guessed 1.5x the prompt, the gateway's ledger",
        ),
        Arm("mico", "mico", True, note="token balance with the served model's predictor"),
        Arm("mico_oracle", "mico", False, note="token balance planning the true lengths"),
        Arm("least_latency", "least_latency", True, note="predicted completion, predictor"),
        Arm("least_latency_oracle", "least_latency", False, note="least_latency, true lengths"),
        Arm(
            "completion_cost",
            "completion_cost",
            True,
            note="the federation's cost model, with what each site caches; predictor",
        ),
        Arm(
            "completion_cost_oracle", "completion_cost", False, note="completion_cost, true lengths"
        ),
        Arm(
            "completion_cost_guess",
            "completion_cost",
            False,
            "prompt_ratio",
            "completion_cost without a predictor: the answer guessed 1.5x the prompt",
        ),
        Arm(
            "completion_cost_adapted",
            "completion_cost",
            True,
            note="completion_cost with the predictor retrained from served traffic",
            source="adapted",
        ),
        Arm(
            "completion_cost_own",
            "completion_cost_own",
            True,
            note="completion_cost without the delay it adds to others (its own ECT), predictor",
        ),
        Arm(
            "completion_cost_balanced",
            "completion_cost_balanced",
            True,
            note="completion_cost and least_tokens, equal weights, predictor",
        ),
        Arm(
            "completion_cost_queues",
            "completion_cost_queues",
            True,
            note="completion_cost without slot_room (may queue at a full site), predictor",
        ),
        Arm("prefix_affinity", "prefix_affinity", False, note="peer rule: longest cached prefix"),
        Arm(
            "dynamo_cost",
            "dynamo_cost",
            False,
            "prompt_only",
            "peer rule (NVIDIA Dynamo): prefill blocks + active blocks, the gateway's ledger",
        ),
        Arm(
            "sglang_router",
            "cache_aware",
            False,
            note="SGLang's own router (sglang-router wheel) in front of the sites' HTTP faces",
            router="sglang",
        ),
    )
}
# The arms of the prefix-reuse workloads (issue 34); peers are the arms compared with the
# federation's policy (`goodput_vs_best_peer`).
PREFIX_ARMS = (
    "round_robin",
    "least_requests",
    "mico",
    "prefix_affinity",
    "dynamo_cost",
    "sglang_router",
    "completion_cost",
    "completion_cost_oracle",
)
PEER_ARMS = ("sglang_router", "prefix_affinity", "dynamo_cost")
DEFAULT_ARMS = (
    "round_robin",
    "least_requests",
    "least_tokens_guess",
    "mico",
    "mico_oracle",
    "least_latency",
)


def _own_ect() -> ProfileSettings:
    """completion_cost with others_weight 0: the ablation of the delay a request adds to the
    requests already at a site (gateway/routing/completion_cost.py)."""
    base = BUILT_IN["completion_cost"]
    scorers = tuple(
        PartSettings.of(s.name, s.weight, **{**s.param_map, "others_weight": 0.0})
        if s.name == "completion_cost"
        else s
        for s in base.scorers
    )
    return ProfileSettings("completion_cost_own", base.filters, scorers, base.picker)


def _balanced() -> ProfileSettings:
    """completion_cost with least_tokens (mico's token balance per unit of capacity) as a second
    scorer of equal weight, both ratio-normalized: a hedge for when the cost model's inputs
    (predicted lengths, configured rates) are wrong."""
    base = BUILT_IN["completion_cost"]
    balance = PartSettings.of("least_tokens", normalize="ratio")
    return ProfileSettings(
        "completion_cost_balanced", base.filters, (*base.scorers, balance), base.picker
    )


def _queues() -> ProfileSettings:
    """completion_cost without the slot_room filter: the ablation (it may queue a request at a
    full site while another has a free batch slot, when the cost model says so)."""
    base = BUILT_IN["completion_cost"]
    filters = tuple(f for f in base.filters if f.name != "slot_room")
    return ProfileSettings("completion_cost_queues", filters, base.scorers, base.picker)


# Profiles the bench adds to every gateway's federation file (`routing_profiles`), for arms
# that are not built in.
BENCH_PROFILES = (_own_ect(), _balanced(), _queues())


def _part_entry(part: PartSettings) -> dict[str, object]:
    return {"name": part.name, "params": part.param_map, "weight": part.weight}


def profile_entry(profile: ProfileSettings) -> dict[str, object]:
    """A profile as the federation file's `routing_profiles` entry (gateway/federation.py)."""
    return {
        "name": profile.name,
        "filters": [_part_entry(f) for f in profile.filters],
        "scorers": [_part_entry(s) for s in profile.scorers],
        "picker": _part_entry(profile.picker),
    }


NO_OFFLOAD = {"GATEWAY_OFFLOAD_ENABLED": "false"}
# The benchmark reads each gateway's /metrics (offloads, failovers) as an operator does.
ADMIN_TOKEN = "federation-bench-admin-credential"
OFFLOAD = {"GATEWAY_OFFLOAD_ENABLED": "true", "GATEWAY_OFFLOAD_INTERVAL_S": "0.25"}


@dataclass
class Gateway:
    """What an arm's requests are sent to: one of our gateways, or SGLang's router."""

    arm: Arm
    label: str
    process: ManagedProcess
    database_url: str = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.process.port}"


@dataclass
class Federation:
    """Owns every process it starts; close() stops them all."""

    preset: Preset
    work_dir: Path
    model_dirs: Mapping[str, Path]  # shape name -> model directory
    tokenizer_dir: Path
    predictor_dir: Path | None
    # The predictor adapted from served traffic (adapt.py), once it exists.
    adapted_predictor_dir: Path | None = None
    sites: dict[str, ManagedProcess] = field(default_factory=dict)
    site_ports: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    proxy_ports: dict[str, int] = field(default_factory=dict)
    # The sites' OpenAI HTTP faces, and the injector's ports in front of them.
    http_ports: dict[str, int] = field(default_factory=dict)
    http_proxy_ports: dict[str, int] = field(default_factory=dict)
    # Per site, what the federation file says beyond its place (prefill_tokens_per_s).
    site_extras: dict[str, dict[str, object]] = field(default_factory=dict)
    # LoRA adapters the sites serve, declared every key's (an undeclared one is nobody's).
    public_adapters: tuple[str, ...] = ()
    # Extra site flags (the host-memory tier, when the engine has it).
    site_args: tuple[str, ...] = ()
    proxy: subprocess.Popen[bytes] | None = None
    gateways: list[Gateway] = field(default_factory=list)

    def start_sites(self, specs: Sequence[SiteSpec] | None = None) -> None:
        """Starts the sites (all of them overlap their start-up), then their injector routes."""
        specs = list(specs or self.preset.sites)
        spawned = []
        for spec in specs:
            port = self.site_ports.setdefault(spec.name, free_port())
            metrics = self.metrics_ports.setdefault(spec.name, free_port())
            http = self.http_ports.setdefault(spec.name, free_port())
            self.proxy_ports.setdefault(spec.name, free_port())
            self.http_proxy_ports.setdefault(spec.name, free_port())
            flags = [*spec.args(), "--metrics-port", str(metrics), "--http-port", str(http)]
            spawned.append(
                spawn_site(
                    model_dir=self.model_dirs[spec.shape],
                    site_name=spec.name,
                    model_name=ROUTED_MODEL,
                    log_dir=self.work_dir / "logs",
                    port=port,
                    extra_args=[*flags, *self.site_args],
                )
            )
        for process in spawned:
            self.sites[process.name] = wait_until_serving(process, timeout_s=600)
        if self.proxy is None:
            self._start_proxy()

    def _start_proxy(self) -> None:
        routes = [
            f"{s.name}:{self.proxy_ports[s.name]}:{self.site_ports[s.name]}:{s.rtt_ms}:{s.jitter_ms}"
            for s in self.preset.sites
        ] + [
            f"{s.name}-http:{self.http_proxy_ports[s.name]}:{self.http_ports[s.name]}:"
            f"{s.rtt_ms}:{s.jitter_ms}"
            for s in self.preset.sites
        ]
        log_path = self.work_dir / "logs" / "wan.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "bench.federation.wan"]
        for route in routes:
            args += ["--route", route]
        with log_path.open("wb") as log_file:
            self.proxy = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while "READY" not in log_path.read_text(errors="replace"):
            if self.proxy.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"the latency injector did not start:\n{log_path.read_text()}")
            time.sleep(0.1)

    def federation_document(self, weights: Mapping[str, float]) -> dict[str, object]:
        adapters = [{"name": name, "parent": ROUTED_MODEL} for name in self.public_adapters]
        return {
            "models": [{"name": ROUTED_MODEL, "tokenizer": str(self.tokenizer_dir)}],
            "sites": [
                {
                    "name": spec.name,
                    "cloud": _PLACES[i % len(_PLACES)][0],
                    "region": _PLACES[i % len(_PLACES)][1],
                    "endpoint": f"127.0.0.1:{self.proxy_ports[spec.name]}",
                    "model": ROUTED_MODEL,
                    "capacity_weight": weights[spec.name],
                    **self.site_extras.get(spec.name, {}),
                }
                for i, spec in enumerate(self.preset.sites)
            ],
            "routing_profiles": [profile_entry(p) for p in BENCH_PROFILES],
            **({"adapters": adapters} if adapters else {}),
        }

    def start_gateway(
        self,
        arm: Arm,
        weights: Mapping[str, float],
        env: Mapping[str, str] | None = None,
        label: str | None = None,
    ) -> Gateway:
        label = label or arm.name
        folder = self.work_dir / "gateways" / label
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("gateway.db*"):
            stale.unlink()
        federation = folder / "federation.json"
        federation.write_text(json.dumps(self.federation_document(weights), indent=2))
        database_url = f"sqlite+aiosqlite:///{folder / 'gateway.db'}"
        settings = {
            "GATEWAY_ROUTING_POLICY": arm.policy,
            "GATEWAY_PLAN_WITHOUT_PREDICTION": arm.plan,
            "GATEWAY_HEALTH_INTERVAL_S": "0.5",
            "GATEWAY_LOAD_REPORT_INTERVAL_MS": "100",
            "GATEWAY_CONNECT_TIMEOUT_S": "10",
            # Open loop past saturation: the sites' queues, not the gateway, hold the backlog.
            "GATEWAY_SITE_MAX_QUEUED_REQUESTS": "0",
            "GATEWAY_MAX_IN_FLIGHT": "1000000",
            "GATEWAY_REQUEST_TIMEOUT_S": "3600",
            "GATEWAY_COLLECT_SAMPLES": "false",
            "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
            **NO_OFFLOAD,
            **self._predictor_setting(arm),
            **(env or {}),
        }
        process = start_gateway(
            federation_file=federation,
            database_url=database_url,
            log_dir=folder,
            env=settings,
            expect_healthy_sites=len(self.sites),
            timeout_s=300,
        )
        gateway = Gateway(arm, label, process, database_url)
        self.gateways.append(gateway)
        return gateway

    def _predictor_setting(self, arm: Arm) -> dict[str, str]:
        adapted = arm.source == "adapted"
        folder = self.adapted_predictor_dir if adapted else self.predictor_dir
        if adapted and folder is None:
            raise ValueError(f"arm {arm.name} needs the adapted predictor: none was built")
        return {"GATEWAY_PREDICTOR_DIR": str(folder)} if arm.predictor and folder else {}

    def start_sglang_router(self, arm: Arm, router_path: Path) -> Gateway:
        """SGLang's router (its Rust policy `arm.policy`) over the sites' HTTP faces, through
        the injector; `router_path` holds the installed sglang-router wheel."""
        port = free_port()
        folder = self.work_dir / "gateways" / arm.name
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / "router.log"
        workers = [f"http://127.0.0.1:{self.http_proxy_ports[s.name]}" for s in self.preset.sites]
        args = [sys.executable, "-m", "bench.federation.sglang_arm", "--worker-urls", *workers]
        args += ["--policy", arm.policy, "--host", "127.0.0.1", "--port", str(port)]
        args += ["--health-check-endpoint", "/health", "--log-level", "warn"]
        paths = [str(router_path), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        with log_path.open("wb") as log_file:
            popen = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        process = ManagedProcess(arm.name, popen, log_path, port)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if not process.alive() or time.monotonic() > deadline:
                process.kill()
                raise LaunchError(f"SGLang's router did not start:\n{process.log_tail()}")
            time.sleep(0.3)
        gateway = Gateway(arm, arm.name, process)
        self.gateways.append(gateway)
        return gateway

    def stop_gateway(self, gateway: Gateway) -> None:
        gateway.process.stop()
        self.gateways.remove(gateway)

    def restart_site(self, spec: SiteSpec) -> None:
        """Starts a site again on its old port (after a kill), behind the same injector route."""
        old = self.sites.pop(spec.name, None)
        if old is not None:
            old.kill()
        self.start_sites([spec])

    def close(self) -> None:
        for gateway in list(self.gateways):
            self.stop_gateway(gateway)
        for process in self.sites.values():
            if process.alive():
                process.popen.send_signal(signal.SIGCONT)  # a throttled site must run to exit
            process.stop()
        self.sites.clear()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            self.proxy.wait(timeout=10)
