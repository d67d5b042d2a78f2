"""`python -m bench.federation --workload lora` (issue 51): adapter-aware routing against
adapter-blind routing, two sites serving the same adapters (bench/federation/lora_workload.py).

Arms: completion_cost, the federation's default profile, which weighs where each adapter is (its
load time in the cost, adapter_affinity among the scorers: gateway/routing/adapter_affinity.py),
against least_requests and mico, which do not. None serves a length predictor: every arm plans
with the true answer lengths, so only the adapters' placement differs. The key,
`goodput_vs_adapter_blind`, is the adapter-aware arm's goodput (the most requests per second that
met the SLO, over the rates) over the better adapter-blind arm's.

Arms run interleaved at each rate (runs.py's sweep), on the same two site processes: a run starts
from the adapters the previous arm's run left resident (every arm in turn does), the steady
state of a federation whose traffic does not stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.federation.cluster import ARMS, Federation
from bench.federation.lora_workload import (
    LoraRuns,
    adapter_names,
    adapter_spread,
    lora_arrivals,
    write_adapters,
)
from bench.federation.metrics import RunSummary
from bench.federation.options import Options
from bench.federation.report import sweep_payload, write
from bench.federation.runs import Runner, sweep
from bench.federation.topology import Preset, SiteSpec, write_model
from bench.federation.workload import describe
from bench.multisite.throttle import stop_all
from fedllm_contract.tokenizer import load_tokenizer

ADAPTER_AWARE = "completion_cost"
ADAPTER_BLIND = ("least_requests", "mico")


def lora_sites(preset: Preset) -> tuple[SiteSpec, SiteSpec]:
    """Two equal sites: the preset's first site, and a copy of it on the second site's device
    and round trip (on one GPU both share it; on several, one a GPU)."""
    first, second = preset.sites[0], preset.sites[1]
    twin = replace(
        first, name="site-2", rtt_ms=second.rtt_ms, jitter_ms=second.jitter_ms,
        device=second.device,
    )  # fmt: skip
    return replace(first, name="site-1"), twin


def goodput_vs_adapter_blind(results: Mapping[str, Sequence[RunSummary]]) -> float | None:
    """The adapter-aware arm's best SLO-met requests per second over the better blind arm's;
    None when an arm is missing or no blind run met the SLO with any request."""
    best = {
        arm: max((r.slo_attained_rps for r in runs), default=0.0) for arm, runs in results.items()
    }
    blind = [best[arm] for arm in ADAPTER_BLIND if arm in best]
    if ADAPTER_AWARE not in best or not blind or max(blind) <= 0:
        return None
    return round(best[ADAPTER_AWARE] / max(blind), 3)


def run_lora(options: Options, command: str, log: Callable[[str], None]) -> Path:
    runs = options.lora
    if runs is None:
        raise ValueError("the lora workload needs its runs (parse_options sets them)")
    started = time.monotonic()
    preset = replace(options.preset, sites=lora_sites(options.preset))
    shape = preset.shape(preset.sites[0].shape)
    vocab = len(load_tokenizer(options.tokenizer_dir))
    model_dir = write_model(
        options.work_dir / "models" / f"{shape.name}-{vocab}", shape, options.tokenizer_dir
    )
    adapters = options.work_dir / "lora" / f"{shape.name}-{vocab}-r{runs.rank}-{len(runs.targets)}p"
    log(f"{runs.adapters} adapters (rank {runs.rank}, {len(runs.targets)} projections): {adapters}")
    write_adapters(adapters, model_dir, runs, options.seed)
    workloads = {
        rate: lora_arrivals(runs, rate, options.seed, vocab) for rate in runs.rates
    }  # fmt: skip
    weights = preset.capacity_weights(vocab)
    payload: dict[str, Any] = {
        "label": _label(preset, runs),
        "preset": preset.name,
        "workload": "lora",
        "lora": asdict(runs),
        "sites": [{**asdict(site), "capacity_weight": weights[site.name]} for site in preset.sites],
        "arms": {name: asdict(ARMS[name]) for name in options.arms},
        "predictor": None,
        "workloads": {
            f"{rate:g}": {**describe(reqs), **adapter_spread(reqs)}
            for rate, reqs in workloads.items()
        },
        "duration_s": runs.duration_s,
        "drain_s": runs.drain_s,
    }
    federation = Federation(
        preset, options.work_dir, {shape.name: model_dir}, options.tokenizer_dir, None,
        site_args=runs.site_args(adapters), public_adapters=tuple(adapter_names(runs.adapters)),
    )  # fmt: skip
    try:
        log("starting 2 sites and the latency injector")
        federation.start_sites()
        runner = Runner(federation, federation.metrics_ports, runs.drain_s, runs.duration_s, log)
        log(f"starting {len(options.arms)} gateways: {', '.join(options.arms)}")
        with ThreadPoolExecutor(max_workers=len(options.arms)) as pool:  # seconds each
            start = federation.start_gateway
            gateways = list(pool.map(lambda name: start(ARMS[name], weights), options.arms))

        def checkpoint(results: Mapping[str, Sequence[RunSummary]]) -> None:
            _store(payload, results, weights)
            write(options.out_dir, options.name, command, payload, options.name)

        results = sweep(runner, gateways, workloads, checkpoint)
        _store(payload, results, weights)
    finally:
        stop_all()
        federation.close()
    payload["elapsed_s"] = round(time.monotonic() - started, 1)
    path = write(options.out_dir, options.name, command, payload, options.name)
    log(f"wrote {path}: goodput_vs_adapter_blind {payload['goodput_vs_adapter_blind']}")
    return path


def _store(
    payload: dict[str, Any],
    results: Mapping[str, Sequence[RunSummary]],
    weights: Mapping[str, float],
) -> None:
    payload["sweep"] = sweep_payload(results, weights)
    payload["goodput_vs_adapter_blind"] = goodput_vs_adapter_blind(results)
    payload["goodput_vs_adapter_blind_means"] = (
        f"{ADAPTER_AWARE}'s best SLO-met requests/s over the better of {', '.join(ADAPTER_BLIND)}"
    )


def _label(preset: Preset, runs: LoraRuns) -> str:
    where = "CPU scale: tiny random models on a shared 2-core machine; only the trend means "
    where += "anything." if preset.name == "cpu" else ""
    if preset.name != "cpu":
        devices = sorted({site.device for site in preset.sites})
        where = f"Preset {preset.name}: two sites on {', '.join(devices)}."
    return (
        f"{where} {runs.adapters} LoRA adapters (rank {runs.rank}) with Zipf({runs.zipf_s:g}) "
        f"popularity, {runs.slots} device slots and {runs.cpu_loras} in host memory a site."
    )
