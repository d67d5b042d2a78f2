"""Runs the phases on one federation and writes the results.

1. Models: a random model per shape of the preset, with the SmolLM2 tokenizer.
2. Sites, the latency injector, and one gateway per compared arm (started together).
3. sweep: every arm at every rate (the same Poisson arrivals for every arm of a rate).
4. scenarios: the site with the most slots slowed mid-run (least_requests and least_latency,
   offload off and on), then killed mid-run (least_latency, offload on; restarted after).
5. decision: routing decision time at 9 sites, every policy (bench.multisite.decision).
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.federation.cluster import ARMS, Federation, Gateway
from bench.federation.metrics import RunSummary
from bench.federation.options import Options, parse_options
from bench.federation.report import finish, sweep_payload, write
from bench.federation.runs import Runner, killed_site, slowed_site, sweep
from bench.federation.topology import write_model
from bench.federation.workload import Pools, Request, arrivals, describe, load_pools
from bench.multisite.throttle import stop_all
from fedllm_contract.tokenizer import load_tokenizer

SLOW_STOPPED_SHARE = 0.8  # the slowed site runs a fifth of the time
SLOW_AT_SHARE = 0.25
KILL_AT_SHARE = 0.4


_STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.0f}s] {message}", flush=True)


def _label(options: Options) -> str:
    preset = options.preset
    if preset.name == "cpu":
        return (
            "**CPU scale: tiny random models on a shared 2-core machine; only the trend means "
            f"anything.** Answers replayed at {preset.answer_scale:g}x their length (cap "
            f"{preset.max_answer_tokens}), prompts capped at {preset.max_prompt_tokens} tokens."
        )
    shapes = ", ".join(shape.name for shape in preset.shapes)
    return f"Preset {preset.name}: {len(preset.sites)} sites; random-weight models {shapes}."


def _workloads(options: Options, pools: Pools) -> dict[float, list[Request]]:
    preset = options.preset
    return {
        rate: arrivals(
            pools,
            rate,
            preset.duration_s,
            options.seed,
            answer_scale=preset.answer_scale,
            max_prompt_tokens=preset.max_prompt_tokens,
            max_answer_tokens=preset.max_answer_tokens,
        )
        for rate in preset.rates
    }


def _federation(options: Options, vocab: int) -> Federation:
    preset = options.preset
    models = {}
    for shape in preset.shapes:
        out = options.work_dir / "models" / f"{shape.name}-{vocab}"
        log(f"model {shape.name}: {shape.parameters(vocab) / 1e6:.1f}M parameters, {out}")
        models[shape.name] = write_model(out, shape, options.tokenizer_dir)
    return Federation(
        preset, options.work_dir, models, options.tokenizer_dir, options.predictor_dir
    )


def run(options: Options, command: str) -> Path:
    started = time.monotonic()
    preset = options.preset
    tokenizer = load_tokenizer(options.tokenizer_dir)
    vocab = len(tokenizer)
    weights = preset.capacity_weights(vocab)
    pools = load_pools(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        vocab,
        data_dir=options.data_dir,
        max_prompt_tokens=preset.max_prompt_tokens,
    )
    workloads = _workloads(options, pools)
    payload: dict[str, Any] = {
        "label": _label(options),
        "preset": preset.name,
        "sites": [{**asdict(site), "capacity_weight": weights[site.name]} for site in preset.sites],
        "arms": {name: asdict(ARMS[name]) for name in options.arms},
        "predictor": str(options.predictor_dir) if options.predictor_dir else None,
        "workload": {f"{rate:g}": describe(reqs) for rate, reqs in workloads.items()},
        "duration_s": preset.duration_s,
        "drain_s": preset.drain_s,
    }
    federation = _federation(options, vocab)
    try:
        if options.phases & {"sweep", "scenarios"}:
            log(f"starting {len(preset.sites)} sites and the latency injector")
            federation.start_sites()
            runner = Runner(
                federation, federation.metrics_ports, preset.drain_s, preset.duration_s, log
            )
        if "sweep" in options.phases:
            gateways = _start_gateways(federation, options.arms, weights)

            def checkpoint(results: Mapping[str, Sequence[RunSummary]]) -> None:
                payload["sweep"] = sweep_payload(results, weights)
                write(options.out_dir, options.name, command, payload, options.name)

            results = sweep(runner, gateways, workloads, checkpoint)
            payload["sweep"] = sweep_payload(results, weights)
            for gateway in gateways:
                federation.stop_gateway(gateway)
        if "scenarios" in options.phases:
            payload["scenarios"] = _scenarios(runner, options, workloads, weights)
    finally:
        stop_all()
        federation.close()
    elapsed = time.monotonic() - started
    return finish(
        options.phases, options.decisions, options.out_dir, options.name, command, payload,
        elapsed, log,
    )  # fmt: skip


def _start_gateways(
    federation: Federation, arms: Sequence[str], weights: dict[str, float]
) -> list[Gateway]:
    log(f"starting {len(arms)} gateways: {', '.join(arms)}")
    # Together: each spends seconds importing and migrating its database.
    with ThreadPoolExecutor(max_workers=len(arms)) as pool:
        return list(pool.map(lambda name: federation.start_gateway(ARMS[name], weights), arms))


def _scenarios(
    runner: Runner,
    options: Options,
    workloads: dict[float, list[Request]],
    weights: dict[str, float],
) -> dict[str, Any]:
    preset = options.preset
    rate = preset.rates[len(preset.rates) // 2]
    requests = workloads[rate]
    fastest = preset.sites[0].name  # the most slots: slowing it hurts most
    log(f"scenario: {fastest} slowed to {1 - SLOW_STOPPED_SHARE:.0%} at {rate:g} rps")
    arms = [ARMS[name] for name in ("least_requests", "least_latency")]
    slowed = slowed_site(
        runner, arms, weights, fastest, rate, requests, SLOW_STOPPED_SHARE, SLOW_AT_SHARE
    )
    victim = fastest  # the site most policies lean on: its loss moves the most work
    log(f"scenario: {victim} killed at {rate:g} rps")
    killed = killed_site(
        runner, ARMS["least_latency"], weights, victim, rate, requests, KILL_AT_SHARE
    )
    return {"slowed_site": slowed, "killed_site": killed}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options = parse_options(args)
    command = shlex.join(["python", "-m", "bench.federation", *args])
    if options.workload == "lora":
        from bench.federation.lora_suite import run_lora

        run_lora(options, command, log)
    elif options.reuse:
        from bench.federation.reuse_suite import run_reuse

        run_reuse(options, command)
    else:
        run(options, command)
    return 0
