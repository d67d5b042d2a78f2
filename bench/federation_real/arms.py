"""One arm's cells through one gateway: the requests of each cell sent open loop from client
processes (bench/serving_path/gpu_path.py's `open_loop`), and what the bench reads around
them:

- the gateway's counters (federation.GATEWAY_COUNTERS) before and after: the requests routing
  placed first on each site, those each site ended completed (the site that finished them,
  after any offload: what fedsim's `by_site` counts), the offloads;
- each role's CPU seconds over the cell (the gateway, each site, the delay proxy, the clients),
  and the chunks and tokens the clients got: the gateway's CPU against what fedsim's model of
  its loop spends on the same work (fedsim/serving_path.py);
- each site's steps (count and seconds) before and after, and its learned step cost
  (fedllm_site_step_cost_seconds, an effective memory of ~200 steps) every SAMPLE_S while the
  cell runs: the twin can step with the card's own fit at the cell's load (sim.py,
  `--step-source learned`), each arm's own, and the time each step's iteration spends outside
  `engine.step()` (step_overhead_s), which the learned cost leaves out; and those samples as a
  series per site (`timeline`: the batch, the steps and their mean, the tokens generated, every
  SAMPLE_S), for what the cell's totals hide.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from bench.federation_real.federation import Federation, deltas, gateway_counters
from bench.federation_real.grid import Cell
from bench.federation_real.metrics import Served, summary
from bench.federation_real.presets import Preset
from bench.federation_real.workload import marked
from bench.loadgen.workload import Request
from bench.serving_path.figures import refusals
from bench.serving_path.gpu_path import open_loop
from devtools.launch import ManagedProcess

SAMPLE_S = 2.0
SAMPLED_AT = "sampled_at_s"  # a sample's seconds since its sampler started (not a metric)
STEP_TERMS = ("base", "per_token", "per_context_position")
_HITS = "fedllm_site_prefix_cache_hits_tokens_total"
_QUERIES = "fedllm_site_prefix_cache_queries_tokens_total"
_STEP_SUM, _STEP_COUNT = "fedllm_site_step_seconds_sum", "fedllm_site_step_seconds_count"


@dataclass
class SiteSampler:
    """Scrapes every site each `interval_s` on a thread of its own until stopped: per site the
    samples taken while it ran requests."""

    federation: Federation
    interval_s: float = SAMPLE_S
    samples: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> SiteSampler:
        self._thread = threading.Thread(target=self._run, name="site-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        began = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                scraped = self.federation.scrape_all()
            except Exception:  # a missed sample is no reason to stop the run
                continue
            for name, values in scraped.items():
                if values.get("fedllm_site_running_requests", 0) > 0:
                    values[SAMPLED_AT] = time.monotonic() - began
                    self.samples.setdefault(name, []).append(values)


def learned_step_cost(samples: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The median of each learned step-cost term over a site's busy samples ({} if none had
    one)."""
    out = {}
    for term in STEP_TERMS:
        key = f"fedllm_site_step_cost_seconds{{{term}}}"
        values = [s[key] for s in samples if key in s]
        if values:
            out[term] = statistics.median(values)
    return out


_GENERATED = "fedllm_site_generated_tokens_total"
_FIRSTS = "fedllm_site_time_to_first_token_seconds_count"
_DECODE_RATE = "fedllm_site_decode_tokens_per_second"


def timeline(samples: Sequence[Mapping[str, float]]) -> list[dict[str, float | None]]:
    """A site's busy samples as a time series: when, its running and waiting requests then, and
    between each sample and the one before it the steps, their mean (engine.step() alone) and
    the tokens generated. What the twin does not see in the cell's totals: the batch a site
    stepped and how long its steps took as the load moved (issue 78: a 1B site's answers
    reached clients at half its step rate, and nothing recorded its rows per step)."""
    series = []
    for before, after in itertools.pairwise(samples):
        steps = after.get(_STEP_COUNT, 0.0) - before.get(_STEP_COUNT, 0.0)
        stepped = after.get(_STEP_SUM, 0.0) - before.get(_STEP_SUM, 0.0)
        series.append({
            "t_s": round(after.get(SAMPLED_AT, 0.0), 3),
            "running": after.get("fedllm_site_running_requests", 0.0),
            "waiting": after.get("fedllm_site_waiting_requests", 0.0),
            "steps": steps,
            "step_s_mean": stepped / steps if steps > 0 else None,
            "generated_tokens": after.get(_GENERATED, 0.0) - before.get(_GENERATED, 0.0),
        })  # fmt: skip
    return series


def step_overhead_s(samples: Sequence[Mapping[str, float]]) -> float:
    """The median seconds a step's iteration spends outside `engine.step()`, over consecutive
    busy samples (0.0 without two): the site's decode rate is its decoded tokens over its steps'
    busy time, timed from before `engine.step()` to after the step's tokens are routed to their
    streams (site_engine/step_rates.py, engine_service.py), where fedllm_site_step_seconds times
    `engine.step()` alone, and the learned step cost is fitted to that. So between two samples
    (SAMPLE_S apart, the rate's window), busy / steps - step seconds / steps: what the service's
    loop adds to each step (stats, routing tokens, cache events), which holds the next step back
    as surely as the step does. Decoded = generated - first tokens."""
    gaps = []
    for before, after in itertools.pairwise(samples):
        steps = after.get(_STEP_COUNT, 0.0) - before.get(_STEP_COUNT, 0.0)
        decoded = after.get(_GENERATED, 0.0) - before.get(_GENERATED, 0.0)
        decoded -= after.get(_FIRSTS, 0.0) - before.get(_FIRSTS, 0.0)
        rate = after.get(_DECODE_RATE, 0.0)
        if steps <= 0 or decoded <= 0 or rate <= 0:
            continue
        stepped = after.get(_STEP_SUM, 0.0) - before.get(_STEP_SUM, 0.0)
        gaps.append(max((decoded / rate - stepped) / steps, 0.0))
    return statistics.median(gaps) if gaps else 0.0


def counter_rows(counters: Mapping[str, float], name: str) -> dict[str, float]:
    """One counter's rows ({"site0-8b/completed": n, ...}) of gateway_counters' keys."""
    prefix = f"fedllm_gateway_{name}_total/"
    return {k.removeprefix(prefix): v for k, v in counters.items() if k.startswith(prefix) and v}


def _sites(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    samples: Mapping[str, Sequence[Mapping[str, float]]],
) -> dict[str, dict[str, Any]]:
    """Each site's steps and mean step over the arm, and the step cost its engine learned while
    this arm ran (learned_step_cost): on a shared CPU a site's steps under one arm are not its
    steps under another (its batches and its neighbours' load differ), and the twin of an arm
    steps each site at that arm's cost (bench/federation_real/sim.py)."""
    steps, seconds = deltas(before, after, _STEP_COUNT), deltas(before, after, _STEP_SUM)
    return {
        name: {"steps": steps[name], "step_s_mean": seconds[name] / steps[name] if steps[name]
               else None, "learned_step_cost_s": learned_step_cost(samples.get(name, [])),
               "step_overhead_s": step_overhead_s(samples.get(name, [])),
               "timeline": timeline(samples.get(name, []))}
        for name in after
    }  # fmt: skip


_SITE_TTFT = "fedllm_site_time_to_first_token_seconds"
_GATEWAY_TTFT = "fedllm_gateway_ttft_seconds"


def _mean(total: float, count: float) -> float | None:
    return total / count if count > 0 else None


def ttft_split(
    gateway: Mapping[str, float],
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    served: Sequence[Served],
) -> dict[str, dict[str, float | None]]:
    """Per site, the mean time to first token as three vantage points saw it over the cell:
    the clients' (send to first text, by the site routing placed it on first), the gateway's
    (its dispatch to the site's first token, by the site that gave it: an offloaded request's
    taker), the site's (its engine's arrival to its first token). Their differences say where a
    request waited: the gateway's ingress and outward stream, the link and the site's ingress,
    or the engine's queue and prefill (over capacity the twin's TTFT p50 was short by 0.3-0.5 s
    and r90's records could not say where)."""
    site_sums = deltas(before, after, f"{_SITE_TTFT}_sum")
    site_counts = deltas(before, after, f"{_SITE_TTFT}_count")
    out: dict[str, dict[str, float | None]] = {}
    for name in after:
        clients = [s.ttft_s for s in served if s.site == name and s.ttft_s is not None]
        site_sum, site_count = site_sums[name], site_counts[name]
        gw_sum = gateway.get(f"{_GATEWAY_TTFT}_sum/{name}", 0.0)
        gw_count = gateway.get(f"{_GATEWAY_TTFT}_count/{name}", 0.0)
        out[name] = {
            "client_mean_s": statistics.fmean(clients) if clients else None,
            "clients": float(len(clients)),
            "gateway_mean_s": _mean(gw_sum, gw_count),
            "gateway_firsts": gw_count,
            "site_mean_s": _mean(site_sum, site_count),
            "site_firsts": site_count,
        }
    return out


def _placement(gateway: dict[str, float]) -> dict[str, Any]:
    finished = counter_rows(gateway, "requests_finished")
    decisions = counter_rows(gateway, "routing_decisions")
    return {
        "by_site": {k.split("/")[0]: int(v) for k, v in sorted(finished.items())
                    if k.endswith("/completed")},
        "placed_first": {k: int(v) for k, v in sorted(decisions.items()) if k != "none"},
        "refused": int(decisions.get("none", 0)),
        "offloads": sum(counter_rows(gateway, "offloads").values()),
        "ended_by_site": {k: int(v) for k, v in sorted(finished.items())},
    }  # fmt: skip


@dataclass
class ArmRun:
    """What running one arm's cells needs: the federation, the arm's gateway, the preset."""

    federation: Federation
    gateway: ManagedProcess
    arm: str
    preset: Preset
    vocab: int
    log: Callable[[str], None]

    def pids(self) -> dict[str, int]:
        pids = {"gateway": self.gateway.popen.pid}
        pids |= {name: site.popen.pid for name, site in self.federation.sites.items()}
        if self.federation.proxy is not None:
            pids["delay_proxy"] = self.federation.proxy.pid
        return pids

    def warm_up(self, requests: Sequence[Request], count: int) -> None:
        """`count` requests 0.1 s apart, a marker of their own, before anything is measured:
        first-call costs (kernels' first shapes, the sites' first streams) stay out of it."""
        warm = [replace(r, at_s=0.1 * i) for i, r in enumerate(requests[:count])]
        self.log(f"warm-up: {len(warm)} requests")
        open_loop(self.gateway.port, marked(warm, "warm-up", self.vocab), 1, 60.0, self.pids())
        if not self.federation.wait_idle(timeout_s=60):
            raise RuntimeError("the sites still had requests 60 s after the warm-up")

    def cell(
        self, cell: Cell, requests: Sequence[Request]
    ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, list[dict[str, float]]]]:
        """The cell's requests under this arm: its figures, every request's outcome, and the
        sites' samples while it ran."""
        federation, preset, marker = self.federation, self.preset, cell.marker(self.arm)
        if not federation.wait_idle(timeout_s=120):
            raise RuntimeError(f"{marker}: the sites still had requests 120 s after the last")
        self.log(f"{marker}: {len(requests)} requests at {cell.rate_rps:.1f} req/s "
                 f"over {preset.duration_s:g} s")  # fmt: skip
        before, counters = federation.scrape_all(), gateway_counters(self.gateway.port)
        with SiteSampler(federation) as sampler:
            sent, cpu, _ = open_loop(self.gateway.port, marked(requests, marker, self.vocab),
                                     preset.clients, preset.drain_s, self.pids())  # fmt: skip
        after = federation.scrape_all()
        gateway = {k: v - counters.get(k, 0.0) for k, v in gateway_counters(self.gateway.port)
                   .items()}  # fmt: skip
        served = [Served.of_sent(r.id, s) for r, s in zip(requests, sent, strict=True)]
        answered = [s for s in sent if s is not None]
        figures = summary(served, preset.slo, preset.duration_s, deltas(before, after, _QUERIES),
                          deltas(before, after, _HITS))  # fmt: skip
        figures |= _placement(gateway) | {
            "marker": marker,
            "errors": list(refusals(answered))[:5],
            "cpu_s": cpu,
            "chunks": sum(s.answer.events for s in answered),
            "delivered_tokens": sum(s.answer.tokens for s in answered),
            "sites": _sites(before, after, sampler.samples),
            "ttft_split": ttft_split(gateway, before, after, served),
        }
        self.log(
            f"{marker}: goodput {figures['goodput_rps']:.2f} req/s, TTFT p50/p99 "
            f"{figures['ttft_p50_s']:.3f}/{figures['ttft_p99_s']:.3f} s, TPOT p50 "
            f"{figures['tpot_p50_s']:.4f} s, completed by site {figures['by_site']} (placed first "
            f"{figures['placed_first']}, {figures['offloads']:g} offloads, {figures['refused']} "
            f"refused), gateway {cpu.get('gateway', 0.0):.1f} CPU s"
        )
        return figures, [asdict(s) for s in served], sampler.samples
