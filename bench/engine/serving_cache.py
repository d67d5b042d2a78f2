"""The serving benchmark's `cache` phase: what prefix caching costs a busy engine (issue 50).

One warmed-up engine serves the same open-loop load at one rate with prefix caching on and off
in turn (PagedEngine.restart_scheduler: an empty cache and scheduler, the same runner and CUDA
graphs), `--prefix-cache-repeat` times each; the order alternates (on, off, off, on, ...) so that
a machine that drifts does not favour an arm, and the two runs of a pair serve the same requests
(pair i draws them with seed + i). The prompts are the short mix (bench.engine.serving_workload)
of which a `--prefix-cache-repeat-fraction` is replaced by prompts drawn with repeats from a pool
of `--prefix-cache-pool` of the mix's own prompts: unique prompts and repeated ones, as a chat
site sees them. Keys:

- prefix_cache_goodput_ratio: output tok/s with the cache on over off, the least of the pairs
  (goal: >= 0.98 at the knee);
- prefix_cache_tpot_p50_ratio: TPOT p50 on over off, the largest of the pairs (goal: <= 1.05);
- prefix_cache: the runs (rows of bench.engine.open_loop.run_rate), the per-pair ratios, and
  whether each run held the SLO.

On the GPU (the 1B shape, 1,024 sequences, 8,192 tokens per step), at the rate to test:

    python -m bench.engine.serving --phases cache --max-num-seqs 1024 \
        --max-num-batched-tokens 8192 --prefix-cache-rate 128 --prefix-cache-repeat 3 \
        --duration-s 30 --slo-ttft-ms 2000 --name engine_serving_prefix_cost_h200

(six runs of 30 s of arrivals and up to 20 s of drain: ~5 minutes after the model is built; a
pair that would not finish before --deadline-s is left out.)
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from bench.engine.engine_runs import warm_up
from bench.engine.open_loop import run_rate
from fedsim.engine_trace import WorkloadRequest
from site_engine.engine.paged_engine import EngineConfig, PagedEngine

if TYPE_CHECKING:
    from bench.engine.serving_run import Run
    from site_engine.model_loading import LoadedModel

ARMS = ("on", "off")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--prefix-cache-rate", type=float, default=None,
        help="cache phase: requests/s of its runs (default: the first of --rates)")  # fmt: skip
    add("--prefix-cache-repeat", type=int, default=3, help="cache phase: runs per arm")
    add("--prefix-cache-repeat-fraction", type=float, default=0.5,
        help="cache phase: share of prompts drawn with repeats from a small pool")  # fmt: skip
    add("--prefix-cache-pool", type=int, default=64, help="cache phase: prompts in that pool")


def with_repeats(
    requests: Sequence[WorkloadRequest], fraction: float, pool_size: int, seed: int
) -> list[WorkloadRequest]:
    """`requests` with a `fraction` of their prompts replaced by prompts drawn (with repeats)
    from the first `pool_size` distinct prompts among them; answer lengths unchanged."""
    pool = list(dict.fromkeys(r.prompt_token_ids for r in requests))[:pool_size]
    rng = random.Random(f"repeats-{seed}")
    out = []
    for request in requests:
        if pool and rng.random() < fraction:
            prompt = rng.choice(pool)
            request = replace(request, prompt_token_ids=prompt, corpus=f"{request.corpus}+pool")
        out.append(request)
    return out


def cache_phase(run: Run, loaded: LoadedModel) -> None:
    args = run.args
    rate = args.prefix_cache_rate or args.rates[0]
    config = EngineConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          prefix_caching=True)  # fmt: skip
    engine = PagedEngine(loaded, config)
    warm_up(engine, run.pools().vocab, min(8, args.max_num_seqs), args.seed)
    result: dict[str, Any] = {"rate_rps": rate, "engine_config": asdict(config),
                              "runs": {arm: [] for arm in ARMS}}  # fmt: skip
    run.payload["prefix_cache"] = result
    for pair in range(args.prefix_cache_repeat):
        if pair and run.time_left() < 2 * (args.duration_s + args.drain_s):
            run.log(f"cache: no time left for pair {pair}; {pair} pair(s) done")
            break  # the pairs done are saved; a half pair would compare nothing
        seed = args.seed + pair

        def make(count: int, rate_seed: int, pair_seed: int = seed) -> list[WorkloadRequest]:
            requests = run.requests("short", count, rate_seed)
            return with_repeats(requests, args.prefix_cache_repeat_fraction,
                                args.prefix_cache_pool, pair_seed)  # fmt: skip

        for arm in ARMS if pair % 2 == 0 else ARMS[::-1]:
            engine.restart_scheduler(prefix_caching=arm == "on", host_tier=False)
            row = run_rate(
                engine, loaded, config, make, mix=f"short+repeats cache {arm}", rate=rate,
                duration_s=args.duration_s, drain_s=args.drain_s, seed=seed, slo=run.slo,
                log=run.log,
            )  # fmt: skip
            row["prefix_cache_hit_fraction"] = _hit_fraction(engine)
            result["runs"][arm].append(row)
            run.save(f"cache pair {pair} {arm}")
    run.payload.update(ratios(result["runs"]))
    engine.close()


def _hit_fraction(engine: PagedEngine) -> float | None:
    stats = engine.stats()
    queries = stats.prefix_cache_queries
    return stats.prefix_cache_hits / queries if queries else None


def ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The headline keys from pairs of runs (pair i: runs["on"][i] and runs["off"][i])."""
    goodput, tpot = [], []
    for on, off in zip(runs["on"], runs["off"], strict=False):
        if off["output_tok_s"]:
            goodput.append(on["output_tok_s"] / off["output_tok_s"])
        if on["tpot_p50_ms"] and off["tpot_p50_ms"]:
            tpot.append(on["tpot_p50_ms"] / off["tpot_p50_ms"])
    return {
        "prefix_cache_goodput_ratio": min(goodput) if goodput else None,
        "prefix_cache_tpot_p50_ratio": max(tpot) if tpot else None,
        "prefix_cache_pair_ratios": {"goodput": goodput, "tpot_p50": tpot},
    }
