"""CPU mode: the real site process with the synthetic engine (bench/serving_path/site.py), the
real gateway (`python -m gateway`, SQLite, the default routing) in front of it, and closed-loop
streaming clients in processes of their own holding `streams` answers open at once.

After the streams' staggered start and a warm-up, `reps` back-to-back windows of `seconds` each
are measured: at each window's edge the site's, the gateway's and the clients' process CPU times
are sampled and the site's counters scraped (its engine's generated tokens and steps); every
answer's text events are noted by the clients at the same edges (bench/serving_path/figures.py).
Then the clients stop sending, what they have open may finish within `drain_s`, and the servers
stop. The gateway runs with its defaults but a longer health deadline (CpuSetup.gateway_env
says why), and what `--gateway-env` sets: its bounds (GATEWAY_MAX_IN_FLIGHT,
GATEWAY_SITE_MAX_QUEUED_REQUESTS) and the site's (--max-queued-requests) are part of what is
measured, and a refusal is reported with its message.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import write_one_site_federation
from bench.federation_real.federation import scrape
from bench.serving_path.clients import ClientProcesses, Job, Sent
from bench.serving_path.cpu_usage import Sample, sample
from bench.serving_path.figures import refusals, spread, window_figures
from bench.serving_path.http_stream import request_bytes
from bench.serving_path.servers import gateway_python, log_problems, log_size, raise_open_files
from devtools.launch import (
    ManagedProcess,
    free_port,
    spawn_site,
    start_gateway,
    wait_until_serving,
)

MODEL = "tiny"
PROMPT = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle, "
    "and tell it slowly, one scene at a time."
)
_GENERATED = "fedllm_site_generated_tokens_total"
_STEPS = "fedllm_site_step_seconds_count"
_ENGINE_THREAD = re.compile(r"synthetic engine thread (\d+)")
HEADLINE = (
    "site_cpu_us_per_token", "gateway_cpu_us_per_token", "clients_cpu_us_per_token",
    "site_engine_thread_cpu_us_per_token", "delivered_tokens_per_s",
    "engine_generated_tokens_per_s", "path_vs_engine_tokens", "ttft_p50_s", "ttft_p99_s",
    "tpot_p50_s", "tokens_per_chunk", "site_loop_busy", "gateway_loop_busy", "site_cores",
    "gateway_cores", "clients_cores",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class CpuSetup:
    streams: int = 1024
    clients: int = 4  # client processes
    max_tokens: int = 256
    rows: int = 1024  # the synthetic engine's rows a step (the site's --max-num-seqs)
    step_ms: float = 10.0
    ramp_s: float = 10.0  # the streams' starts spread over this
    warmup_s: float = 45.0  # from the first stream's start to the first window
    seconds: float = 30.0  # one window
    reps: int = 3
    drain_s: float = 120.0
    # The gateway's defaults but for its health deadline: at 1,024 streams on the 2-core machine
    # the site's health checks go unanswered within the 2 s default (a loop seconds behind),
    # three in a row mark it unhealthy, and the gateway refuses nearly every request as "no site
    # can serve" though the site has free rows (serving_path_cpu_before_defaults.md): that
    # measures refusing, not the path.
    gateway_env: dict[str, str] = field(default_factory=lambda: {"GATEWAY_CONNECT_TIMEOUT_S": "30"})

    @property
    def capacity_tokens_per_s(self) -> float:
        return self.rows / (self.step_ms / 1000.0)


def _jobs(setup: CpuSetup, port: int, start: float, edges: Sequence[float]) -> list[Job]:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": setup.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = request_bytes(port, body)
    share, extra = divmod(setup.streams, setup.clients)
    counts = [share + (i < extra) for i in range(setup.clients)]
    return [
        Job(port, (request,), start, edges[-1], setup.drain_s, streams=count,
            ramp_s=setup.ramp_s, windows=tuple(edges))
        for count in counts if count
    ]  # fmt: skip


@dataclass
class Servers:
    site: ManagedProcess
    gateway: ManagedProcess
    metrics_port: int
    # Where their logs stood once both served: the gateway, started beside the site, logs it
    # unhealthy until it serves, which is no finding.
    log_start: dict[str, int] = field(default_factory=dict)

    def log_problems(self) -> dict[str, dict[str, int]]:
        return {
            name: log_problems(process.log_path, self.log_start.get(name, 0))
            for name, process in (("site", self.site), ("gateway", self.gateway))
        }

    def stop(self) -> None:
        # The gateway first: a site gone under it would be logged unhealthy.
        self.gateway.stop(timeout_s=30)
        self.site.stop(timeout_s=30)

    def engine_thread(self) -> int | None:
        found = _ENGINE_THREAD.search(self.site.log_path.read_text(errors="replace"))
        return int(found.group(1)) if found else None


def start_servers(
    setup: CpuSetup, work: Path, model_dir: Path, log: Callable[[str], None]
) -> Servers:
    """The site and the gateway, started at once (the gateway waits until the site serves)."""
    metrics_port, port = free_port(), free_port()
    args = ["--max-num-seqs", str(setup.rows), "--metrics-port", str(metrics_port),
            "--step-ms", str(setup.step_ms)]  # fmt: skip
    site = spawn_site(model_dir=model_dir, site_name="synthetic", model_name=MODEL,
                      log_dir=work / "logs", port=port, extra_args=args,
                      module="bench.serving_path.site")  # fmt: skip
    federation = work / "federation.json"
    write_one_site_federation(federation, model_dir, port)
    for stale in work.glob("gateway.db*"):
        stale.unlink()
    try:
        gateway = start_gateway(
            federation_file=federation, database_url=f"sqlite+aiosqlite:///{work / 'gateway.db'}",
            log_dir=work / "logs", env=setup.gateway_env, timeout_s=240, python=gateway_python(),
        )  # fmt: skip
        wait_until_serving(site, timeout_s=60)
    except BaseException:
        site.stop()
        raise
    log(f"site (pid {site.popen.pid}) and gateway (pid {gateway.popen.pid}) serving")
    start = {"site": log_size(site.log_path), "gateway": log_size(gateway.log_path)}
    return Servers(site, gateway, metrics_port, start)


def _measure(
    setup: CpuSetup, servers: Servers, log: Callable[[str], None]
) -> tuple[list[list[Sent]], list[Sample], list[float], list[dict[str, float]]]:
    """Runs the clients; the CPU samples and site scrapes at each window edge."""
    start = time.monotonic() + 1.0
    edges = [start + setup.warmup_s + k * setup.seconds for k in range(setup.reps + 1)]
    clients = ClientProcesses(_jobs(setup, servers.gateway.port, start, edges))
    clients.start()
    roles = {"site": [servers.site.popen.pid], "gateway": [servers.gateway.popen.pid],
             "clients": clients.pids}  # fmt: skip
    samples: list[Sample] = []
    scrapes: list[dict[str, float]] = []
    try:
        for edge in edges:
            time.sleep(max(0.0, edge - time.monotonic()))
            samples.append(sample(roles))
            scrapes.append(scrape(servers.metrics_port))
            _progress(samples, scrapes, log)
        sent = [items for items, _ in clients.gather(timeout_s=setup.drain_s + 60)]
    finally:
        clients.kill()
    return sent, samples, edges, scrapes


def _progress(
    samples: Sequence[Sample], scrapes: Sequence[Mapping[str, float]], log: Callable[[str], None]
) -> None:
    """A line per window edge: the engine's tokens/s and each role's cores since the last."""
    if len(samples) < 2:
        log(f"warm-up over: {scrapes[0].get('fedllm_site_running_requests', 0):.0f} running")
        return
    before, after = samples[-2], samples[-1]
    wall = after.at_s - before.at_s
    generated = (scrapes[-1][_GENERATED] - scrapes[-2][_GENERATED]) / wall
    cores = ", ".join(
        f"{role} {(usage.cpu_s - before.roles[role].cpu_s) / wall:.2f}"
        for role, usage in after.roles.items()
    )
    log(f"window {len(samples) - 1}: engine {generated:,.0f} tok/s, cores {cores}")


def _windows(
    sent: Sequence[Sent],
    samples: Sequence[Sample],
    edges: Sequence[float],
    scrapes: Sequence[Mapping[str, float]],
    setup: CpuSetup,
    engine_thread: int | None,
) -> list[dict[str, Any]]:
    windows = []
    for k in range(setup.reps):
        figures = window_figures(sent, samples, edges, k)
        wall = edges[k + 1] - edges[k]
        generated = scrapes[k + 1][_GENERATED] - scrapes[k][_GENERATED]
        figures["engine_generated_tokens_per_s"] = generated / wall
        figures["engine_steps_per_s"] = (scrapes[k + 1][_STEPS] - scrapes[k][_STEPS]) / wall
        figures["path_vs_engine_tokens"] = (
            figures["delivered_tokens_per_s"] / setup.capacity_tokens_per_s
        )
        if engine_thread is not None and figures["delivered_tokens"]:
            before = samples[k].roles["site"].threads.get(engine_thread, 0.0)
            after = samples[k + 1].roles["site"].threads.get(engine_thread, 0.0)
            figures["site_engine_thread_cpu_us_per_token"] = (
                1e6 * (after - before) / figures["delivered_tokens"]
            )
        windows.append(figures)
    return windows


def run_cpu(
    setup: CpuSetup, work: Path, model_dir: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """The module docstring's run; its results payload."""
    raise_open_files(setup.streams * 2 + 256)
    servers = start_servers(setup, work, model_dir, log)
    try:
        sent_by_process, samples, edges, scrapes = _measure(setup, servers, log)
        engine_thread = servers.engine_thread()
    finally:
        servers.stop()
    sent = [item for items in sent_by_process for item in items]
    windows = _windows(sent, samples, edges, scrapes, setup, engine_thread)
    ranges = {key: spread(windows, key) for key in HEADLINE}
    answers = [s.answer for s in sent]
    return {
        "mode": "cpu",
        "setup": asdict(setup),
        "engine_capacity_tokens_per_s": setup.capacity_tokens_per_s,
        **{key: value["median"] for key, value in ranges.items()},
        "ranges": ranges,
        "windows": windows,
        "requests": {
            "sent": len(sent),
            "finished": sum(a.complete for a in answers),
            "refused": sum(a.status not in (0, 200) for a in answers),
            "cut": sum(
                not s.cut and not s.answer.complete and s.answer.status in (0, 200) for s in sent
            ),
            "open_at_the_end": sum(s.cut for s in sent),
        },
        "refusals": refusals(sent),
        "logs": servers.log_problems(),
        "client_processes": len(sent_by_process),
    }
