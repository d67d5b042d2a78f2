"""Measured runs: the policy sweep (every arm at every rate, the same requests for every arm of
a rate, arms interleaved within a rate so slow drift of a shared machine does not favour one),
and the offload scenarios (a site slowed mid-run, a site killed mid-run).

Between runs the benchmark waits until every site is idle (its Prometheus gauges: nothing
waiting, nothing running), so no run inherits another's backlog. What a gateway did (offloads,
failovers, continuations) comes from its own /metrics, read with the admin credential.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bench.federation.cluster import ADMIN_TOKEN, OFFLOAD, Arm, Federation, Gateway
from bench.federation.hit_rate import measured_hit_rate, prefix_counters, simulated_hit_rate
from bench.federation.loadgen import CUT_OFF, RunOutcomes, run_open_loop
from bench.federation.metrics import TTFT_SLO_S, RunSummary, summarize
from bench.federation.workload import Request
from bench.multisite.throttle import Throttle

_SAMPLE = re.compile(r"^(fedllm_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", re.MULTILINE)


def prometheus_sums(text: str) -> dict[str, float]:
    """Each metric's samples summed over their labels."""
    sums: dict[str, float] = {}
    for name, _labels, value in _SAMPLE.findall(text):
        if value != "NaN":
            sums[name] = sums.get(name, 0.0) + float(value)
    return sums


def site_metrics(metrics_ports: Mapping[str, int]) -> dict[str, str]:
    """Each site's Prometheus exposition (unreachable sites are left out)."""
    texts: dict[str, str] = {}
    for name, port in metrics_ports.items():
        try:
            texts[name] = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
    return texts


def site_busy(metrics_ports: Mapping[str, int]) -> dict[str, float]:
    """Requests waiting or running at each site (unreachable sites are left out)."""
    busy: dict[str, float] = {}
    for name, text in site_metrics(metrics_ports).items():
        sums = prometheus_sums(text)
        busy[name] = sums.get("fedllm_site_waiting_requests", 0.0) + sums.get(
            "fedllm_site_running_requests", 0.0
        )
    return busy


def wait_idle(metrics_ports: Mapping[str, int], timeout_s: float = 300.0) -> float:
    """Blocks until no site has work; returns how long that took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if not any(site_busy(metrics_ports).values()):
            return time.monotonic() - started
        time.sleep(0.25)
    raise TimeoutError(f"sites still busy after {timeout_s:.0f}s: {site_busy(metrics_ports)}")


def site_snapshot(metrics_ports: Mapping[str, int]) -> dict[str, SiteCounters]:
    """Each site's finished requests and prefix-cache counters (unreachable sites left out)."""
    snapshot: dict[str, SiteCounters] = {}
    for name, text in site_metrics(metrics_ports).items():
        finished = prometheus_sums(text).get("fedllm_site_requests_finished_total", 0.0)
        snapshot[name] = SiteCounters(finished, prefix_counters(text))
    return snapshot


@dataclass(frozen=True, slots=True)
class SiteCounters:
    finished: float
    prefix: tuple[float, float] | None  # (queries, hits), None: the site does not cache


def gateway_counters(gateway: Gateway) -> dict[str, float]:
    if gateway.arm.router != "gateway":
        return {}  # SGLang's router: no offload, failover or continuation to count
    response = httpx.get(
        f"{gateway.base_url}/metrics",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    response.raise_for_status()
    sums = prometheus_sums(response.text)
    return {
        "offloads": sums.get("fedllm_gateway_offloads_total", 0.0),
        "failovers": sums.get("fedllm_gateway_failovers_total", 0.0),
        "continuations": sums.get("fedllm_gateway_continuations_total", 0.0),
    }


@dataclass
class Runner:
    federation: Federation
    metrics_ports: Mapping[str, int]
    drain_s: float
    duration_s: float
    log: Callable[[str], None]
    # Each site's KV capacity in tokens: the simulated hit rate's caches (None: not computed).
    capacity_tokens: Mapping[str, int] | None = None

    def run(
        self,
        gateway: Gateway,
        rate: float,
        requests: Sequence[Request],
        label: str | None = None,
        during: Callable[[], None] | None = None,
        during_at_s: float = 0.0,
    ) -> RunSummary:
        """One open-loop run; `during` is called `during_at_s` after the start (a slowdown, a
        kill), from a timer thread."""
        waited = wait_idle(self.metrics_ports)
        before = gateway_counters(gateway)
        sites_before = site_snapshot(self.metrics_ports)
        timer = threading.Timer(during_at_s, during) if during is not None else None
        if timer is not None:
            timer.start()
        try:
            outcomes = asyncio.run(run_open_loop(gateway.base_url, requests, self.drain_s))
        finally:
            if timer is not None:
                timer.cancel()
        after = gateway_counters(gateway)
        moved = {key: after[key] - before[key] for key in after}
        moved.update(self._site_view(requests, outcomes, sites_before))
        summary = summarize(
            label or gateway.arm.name,
            rate,
            self.duration_s,
            outcomes,
            policy=gateway.arm.policy,
            predictor=gateway.arm.predictor and self.federation.predictor_dir is not None,
            wall_s=round(outcomes.wall_s, 2),
            idle_wait_s=round(waited, 2),
            **moved,
        )
        self.log(
            f"  {summary.arm:<22} {rate:>6g} rps: {summary.completed}/{summary.requests} ok "
            f"(+{summary.cut_off_streaming} streaming at the cut), "
            f"hit {summary.extra.get('hit_rate_simulated', {}).get('all', '-')}, "
            f"TTFT p50/p99 {summary.ttft_p50_s:.2f}/{summary.ttft_p99_s:.2f}s, "
            f"TPOT p99 {1000 * summary.tpot_p99_s:.0f}ms, "
            f"SLO {'held' if summary.holds_slo else 'missed'}"
        )
        late = [r for r in summary.slowest if r["ttft_s"] is None or r["ttft_s"] > TTFT_SLO_S]
        for row in late:
            self.log(
                f"    late first token: {row['site']} sent at {row['sent_s']:.2f}s, prompt "
                f"{row['prompt_tokens']}, answer {row['answer_tokens']}, TTFT {row['ttft_s']}, "
                f"{row['ended']}"
            )
        return summary

    def _site_view(
        self,
        requests: Sequence[Request],
        outcomes: RunOutcomes,
        before: Mapping[str, SiteCounters],
    ) -> dict[str, Any]:
        """What the sites did during the run: requests finished each (SGLang's router does not
        say where it sent a request; the sites do), the measured and simulated hit rates."""
        after = site_snapshot(self.metrics_ports)
        view: dict[str, Any] = {
            "site_requests": {
                site: round(after[site].finished - before[site].finished)
                for site in sorted(after)
                if site in before
            },
            "hit_rate_measured": measured_hit_rate(
                {site: c.prefix for site, c in before.items()},
                {site: c.prefix for site, c in after.items()},
            ),
        }
        served = [
            (outcome.site, request)
            for outcome, request in zip(outcomes.outcomes, requests, strict=True)
            if outcome.site is not None
        ]
        if self.capacity_tokens is not None and served:
            view["hit_rate_simulated"] = simulated_hit_rate(served, self.capacity_tokens)
        # Requests naming LoRA adapters (the lora workload): over how many sites each adapter's
        # requests went, on average (1: each adapter kept on one site).
        adapter_sites: dict[str, set[str]] = {}
        for site, request in served:
            if request.model is not None:
                adapter_sites.setdefault(request.model, set()).add(site)
        if adapter_sites:
            spread = sum(map(len, adapter_sites.values())) / len(adapter_sites)
            view["sites_per_adapter"] = round(spread, 3)
        return view


def sweep(
    runner: Runner,
    gateways: Sequence[Gateway],
    workloads: Mapping[float, Sequence[Request]],
    after_rate: Callable[[Mapping[str, list[RunSummary]]], None] | None = None,
) -> dict[str, list[RunSummary]]:
    """`after_rate` sees the results so far once every arm ran a rate (a checkpoint: a run cut
    short by a time limit still leaves its finished rates)."""
    results: dict[str, list[RunSummary]] = {g.arm.name: [] for g in gateways}
    for rate, requests in workloads.items():
        runner.log(f"rate {rate:g} rps: {len(requests)} requests")
        for gateway in gateways:
            results[gateway.arm.name].append(runner.run(gateway, rate, requests))
        if after_rate is not None:
            after_rate(results)
    return results


def slowed_site(
    runner: Runner,
    arms: Sequence[Arm],
    weights: Mapping[str, float],
    site: str,
    rate: float,
    requests: Sequence[Request],
    stopped_share: float,
    at_share: float,
) -> dict[str, object]:
    """The site runs `1 - stopped_share` of the time from `at_share` of the arrival window on
    (SIGSTOP/SIGCONT cycles: a noisy neighbour), with offload off and on."""
    pid = runner.federation.sites[site].popen.pid
    runs = []
    for arm in arms:
        for offload in (False, True):
            label = f"{arm.name}{'+offload' if offload else ''}"
            gateway = runner.federation.start_gateway(
                arm, weights, OFFLOAD if offload else {}, label=f"slow-{label}"
            )
            throttle = Throttle((pid,), stopped_share)
            try:
                runs.append(
                    runner.run(
                        gateway,
                        rate,
                        requests,
                        label=label,
                        during=throttle.start,
                        during_at_s=at_share * runner.duration_s,
                    )
                )
            finally:
                throttle.stop()
                runner.federation.stop_gateway(gateway)
    return {
        "site": site,
        "speed_while_slowed": round(1 - stopped_share, 3),
        "slowed_at_share_of_arrivals": at_share,
        "rate_rps": rate,
        "runs": [run.to_json() for run in runs],
    }


def killed_site(
    runner: Runner,
    arm: Arm,
    weights: Mapping[str, float],
    site: str,
    rate: float,
    requests: Sequence[Request],
    at_share: float,
) -> dict[str, object]:
    """The site's process is killed at `at_share` of the arrival window; offload on. Then it is
    started again for whatever runs next."""
    federation = runner.federation
    gateway = federation.start_gateway(arm, weights, OFFLOAD, label="killed")
    spec = next(s for s in federation.preset.sites if s.name == site)
    ports = {k: v for k, v in runner.metrics_ports.items() if k != site}
    survivors = Runner(federation, ports, runner.drain_s, runner.duration_s, runner.log)
    try:
        run = survivors.run(
            gateway,
            rate,
            requests,
            label=f"{arm.name}+offload, {site} killed",
            during=federation.sites[site].kill,
            during_at_s=at_share * runner.duration_s,
        )
    finally:
        federation.stop_gateway(gateway)
        federation.restart_site(spec)
    return {
        "site": site,
        "killed_at_share_of_arrivals": at_share,
        "rate_rps": rate,
        "policy": arm.name,
        "requests": run.requests,
        "completed": run.completed,
        # Not finished when the drain ended (still streaming: the benchmark hung up) is not
        # lost; failed is any other error a client saw.
        "cut_off_at_drain": sum(1 for e in run.errors if e.startswith(CUT_OFF)),
        "failed": sum(1 for e in run.errors if not e.startswith(CUT_OFF)),
        "answered_by_killed_site": run.requests_per_site.get(site, 0),
        "run": run.to_json(),
    }
