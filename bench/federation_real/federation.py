"""The real federation's processes: one `python -m site_engine` per site (CUDA_VISIBLE_DEVICES
its GPU), the wide-area delay in front of each (`python -m bench.federation_real.wan`), and one
`python -m gateway` per arm, started after the previous arm's gateway stopped (so offload is on:
no other gateway's requests sit in the sites' queues), its settings GATEWAY's, the same object
the simulated gateway runs with (bench/federation_real/sim.py).

Every gateway names the sites by their delay ports: its health checks, Info calls, load-report
streams and generation streams all cross the emulated link. The bench reads each site's own
Prometheus endpoint (not delayed) for its prefix-cache counters, KV blocks, queue, and the step
cost the engine learned.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.federation_real.presets import Preset, SiteSetup
from bench.loadgen.workload import ROUTED_MODEL
from devtools.launch import (
    LaunchError,
    ManagedProcess,
    free_port,
    spawn_site,
    start_gateway,
    stop_all,
    wait_until_serving,
)
from fedsim.gateway import GatewaySettings
from fedsim.serving_path import ServingCosts

ADMIN_TOKEN = "federation-real-bench-admin-credential"
# The gateway's settings in every arm, real and simulated (policy set per arm): the gateway's
# defaults, except the health interval (a site's readiness shows sooner; no site fails here).
# `serving`: what the simulated gateway's loop and the sites' serving threads spend (the CPU-mode
# serving-path benchmark's costs), and the chunk budget both gateways pace answers with.
GATEWAY = GatewaySettings(
    policy="completion_cost",
    unpredicted="max_tokens",
    load_report_interval_s=0.25,
    health_interval_s=0.5,
    site_max_queued_requests=256,
    offload=True,
    offload_interval_s=0.5,
    offload_transfer_cost_s=0.05,
    serving=ServingCosts(),
)
_SAMPLE = re.compile(r"^(fedllm_site_[a-z_]+)(?:\{([^}]*)\})? ([-+0-9.eEinfNa]+)$")
# The gateway's counters the bench reads per cell, and the labels that name a row of each.
GATEWAY_COUNTERS = {
    "fedllm_gateway_routing_decisions_total": ("site",),  # first placements ('none': refused)
    "fedllm_gateway_requests_finished_total": ("site", "status"),  # by the site that ended it
    "fedllm_gateway_offloads_total": ("giver", "taker"),
    # Time to first token from dispatch (routing included) to the site's first token, per site:
    # with the site's own (engine arrival to first token) and the client's, where a wait is.
    "fedllm_gateway_ttft_seconds_sum": ("site",),
    "fedllm_gateway_ttft_seconds_count": ("site",),
}
# A site's samples kept summed over their labels (scrape), not the last row's.
_SUMMED = frozenset(
    {"fedllm_site_time_to_first_token_seconds_sum", "fedllm_site_time_to_first_token_seconds_count"}
)


def gateway_env(settings: GatewaySettings) -> dict[str, str]:
    """`settings` as the real gateway's environment."""
    return {
        "GATEWAY_ROUTING_POLICY": settings.policy,
        "GATEWAY_PLAN_WITHOUT_PREDICTION": settings.unpredicted,
        "GATEWAY_LOAD_REPORT_INTERVAL_MS": str(round(settings.load_report_interval_s * 1000)),
        "GATEWAY_HEALTH_INTERVAL_S": str(settings.health_interval_s),
        "GATEWAY_SITE_MAX_QUEUED_REQUESTS": str(settings.site_max_queued_requests or 0),
        "GATEWAY_OFFLOAD_ENABLED": "true" if settings.offload else "false",
        "GATEWAY_OFFLOAD_INTERVAL_S": str(settings.offload_interval_s),
        "GATEWAY_OFFLOAD_TRANSFER_COST_S": str(settings.offload_transfer_cost_s),
        **(
            {
                "GATEWAY_STREAM_CHUNKS_PER_S": str(settings.serving.chunks_per_s),
                "GATEWAY_STREAM_CHUNKS_MIN_PER_S": str(settings.serving.chunks_min_per_s),
            }
            if settings.serving is not None
            else {}
        ),
        # The bench measures routing, not admission control or the request log.
        "GATEWAY_MAX_IN_FLIGHT": "1000000",
        "GATEWAY_REQUEST_TIMEOUT_S": "3600",
        "GATEWAY_COLLECT_SAMPLES": "false",
        "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
        "GATEWAY_CONNECT_TIMEOUT_S": "10",
    }


def scrape(port: int) -> dict[str, float]:
    """A site's fedllm_site_* samples: {name, or name{term} for the step cost's terms: value}."""
    return parse_site(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)


def parse_site(text: str) -> dict[str, float]:
    """scrape's samples of a site's Prometheus exposition: _SUMMED's summed over their rows
    (the first-token histogram has one per priority class), any other the last row's."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            if name in _SUMMED:
                out[name] = out.get(name, 0.0) + float(value)
                continue
            term = re.search(r'term="([a-z_]+)"', labels or "")
            out[f"{name}{{{term.group(1)}}}" if term else name] = float(value)
    return out


def gateway_counters(port: int) -> dict[str, float]:
    """The gateway's GATEWAY_COUNTERS now (parse_counters)."""
    text = httpx.get(
        f"http://127.0.0.1:{port}/metrics",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    ).text
    return parse_counters(text)


def parse_counters(text: str) -> dict[str, float]:
    """GATEWAY_COUNTERS in a Prometheus exposition as {"name/label/label": value} (labels in
    the order GATEWAY_COUNTERS names them), summed over the labels it does not name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = GATEWAY_COUNTERS.get(sample.name)
            if labels is None:
                continue
            key = "/".join([sample.name, *(sample.labels.get(label, "") for label in labels)])
            out[key] = out.get(key, 0.0) + sample.value
    return out


@dataclass
class Federation:
    """Owns every process it starts; close() stops them all."""

    preset: Preset
    work_dir: Path
    model_dirs: Mapping[str, Path]  # shape -> model directory
    tokenizer_dir: Path
    sites: dict[str, ManagedProcess] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    delay_ports: dict[str, int] = field(default_factory=dict)
    proxy: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> None:
        """Every site at once (their starts overlap), then the delays in front of them."""
        spawned = []
        for spec in self.preset.sites:
            self.metrics_ports[spec.name] = free_port()
            self.delay_ports[spec.name] = free_port()
            env = {"CUDA_VISIBLE_DEVICES": str(spec.gpu)} if spec.gpu is not None else {}
            args = [*spec.engine_args(self.preset.dtype), "--metrics-port"]
            spawned.append(
                spawn_site(
                    model_dir=self.model_dirs[spec.shape],
                    site_name=spec.name,
                    model_name=ROUTED_MODEL,
                    log_dir=self.work_dir / "logs",
                    port=free_port(),
                    extra_args=[*args, str(self.metrics_ports[spec.name])],
                    env=env,
                )
            )
        try:
            for process in spawned:
                self.sites[process.name] = wait_until_serving(process, timeout_s)
        except BaseException:
            stop_all(spawned)
            raise
        self._start_delays()

    def _start_delays(self) -> None:
        routes = [
            f"{s.name}:{self.delay_ports[s.name]}:{self.sites[s.name].port}:{s.one_way_ms:g}"
            for s in self.preset.sites
        ]
        log_path = self.work_dir / "logs" / "wan.log"
        args = [sys.executable, "-m", "bench.federation_real.wan"]
        for route in routes:
            args += ["--route", route]
        with log_path.open("wb") as log_file:
            self.proxy = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while "READY" not in log_path.read_text(errors="replace"):
            if self.proxy.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"the delay proxy did not start:\n{log_path.read_text()}")
            time.sleep(0.1)

    def federation_document(self) -> dict[str, object]:
        return {
            # Absolute: each gateway runs in a folder of its own, so a relative path missed.
            "models": [{"name": ROUTED_MODEL, "tokenizer": str(self.tokenizer_dir.resolve())}],
            "sites": [
                {
                    "name": s.name,
                    "cloud": "bench",
                    "region": f"one-way-{s.one_way_ms:g}ms",
                    "endpoint": f"127.0.0.1:{self.delay_ports[s.name]}",
                    "model": ROUTED_MODEL,
                }
                for s in self.preset.sites
            ],
        }

    def start_gateway(
        self, arm: str, settings: GatewaySettings, extra_env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """`extra_env`: GATEWAY_* settings over those of `settings`."""
        folder = self.work_dir / "gateways" / arm
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("gateway.db*"):
            stale.unlink()
        federation = folder / "federation.json"
        federation.write_text(json.dumps(self.federation_document(), indent=2))
        return start_gateway(
            federation_file=federation,
            database_url=f"sqlite+aiosqlite:///{folder / 'gateway.db'}",
            log_dir=folder,
            env=gateway_env(settings) | dict(extra_env or {}),
            expect_healthy_sites=len(self.sites),
            timeout_s=300,
        )

    def scrape_all(self) -> dict[str, dict[str, float]]:
        return {name: scrape(port) for name, port in self.metrics_ports.items()}

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no site runs or queues a request (an arm's cut-off requests cancelled)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            samples = self.scrape_all().values()
            busy = sum(
                s.get("fedllm_site_running_requests", 0) + s.get("fedllm_site_waiting_requests", 0)
                for s in samples
            )
            if busy == 0:
                return True
            time.sleep(0.5)
        return False

    def close(self) -> None:
        stop_all(list(self.sites.values()), timeout_s=30)
        self.sites.clear()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            self.proxy.wait(timeout=10)


def site_record(spec: SiteSetup, samples: Mapping[str, float]) -> dict[str, object]:
    """What the simulated replay needs of a real site, and what it measured of itself."""
    return {
        "name": spec.name,
        "shape": spec.shape,
        "gpu": spec.gpu,
        "one_way_ms": spec.one_way_ms,
        "max_num_seqs": spec.max_num_seqs,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
        "context": spec.context,
        "kv_blocks_total": int(samples.get("fedllm_site_kv_blocks_total", 0)),
        "step_cost_s": {
            term: samples[f"fedllm_site_step_cost_seconds{{{term}}}"]
            for term in ("base", "per_token", "per_context_position")
            if f"fedllm_site_step_cost_seconds{{{term}}}" in samples
        },
        "step_seconds_sum": samples.get("fedllm_site_step_seconds_sum", 0.0),
        "steps": samples.get("fedllm_site_step_seconds_count", 0.0),
    }


def deltas(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]], key: str
) -> dict[str, float]:
    """Per site, how much counter `key` grew between two scrapes."""
    return {name: after[name].get(key, 0.0) - before[name].get(key, 0.0) for name in after}


def card_of(sites: Sequence[SiteSetup]) -> str:
    """The fedsim card the sites run on: the GPU's model name (h100, h200), or cpu."""
    gpus = [s.gpu for s in sites if s.gpu is not None]
    if not gpus:
        return "cpu"
    import torch

    names = {torch.cuda.get_device_name(g).lower() for g in gpus}
    cards = {c for c in ("h100", "h200") if any(c in n for n in names)}
    if len(cards) != 1:
        raise ValueError(f"GPUs {sorted(names)}: not one card fedsim models (h100 or h200)")
    return cards.pop()
