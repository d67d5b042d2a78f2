"""Runs the phases in order on one cluster and writes the results.

Phases: Table 1 (with the batch-API columns, the predictor ablation's extra columns in one cell,
and the bad-input checks on the first batch size's gateway), the scenarios, and the
routing-decision timing.
"""

from __future__ import annotations

import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.multisite.bad_input import run_checks
from bench.multisite.cluster import Cluster, Gateway, SiteSpec
from bench.multisite.decision import time_decisions
from bench.multisite.metrics import Cell
from bench.multisite.options import Options, parse_options
from bench.multisite.report import Results, write
from bench.multisite.runner import Bench
from bench.multisite.scenarios import EQUAL_MODEL, ScenarioSettings, run_scenarios
from bench.multisite.table1 import ITER_MODEL, NO_OFFLOAD, STATIC_MODEL, Extra, run_batch_size
from bench.multisite.throttle import stop_all
from bench.multisite.workload import Query, Workload, load_workload, skewed
from devtools.launch import free_port
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.make_model import make_model_dir
from site_engine.model_loading import load_model

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 1024  # the random model's context (max_position_embeddings)
DEAD_MODEL = "tiny-nowhere"
BLOCK_SIZE = 16
# Every batch item of a site in flight at once, as in the burst: the site's own scheduler, not
# the gateway, decides what runs (the gateway's default keeps 16 per site).
BATCH_SITE_CONCURRENCY = 4096


def log(message: str) -> None:
    print(message, flush=True)


def prepare_model(work_dir: Path, tokenizer_dir: Path) -> Path:
    """A random tiny Llama saved with save_pretrained; sites load it through the real path."""
    model_dir = work_dir / "models" / MODEL_NAME
    if not (model_dir / "model.safetensors").is_file():
        log(f"building a random {MODEL_NAME} in {model_dir}")
        make_model_dir(model_dir, "llama", tokenizer_dir)
    return model_dir


def kv_cache_mib(model_dir: Path, workload_tokens: int, most_holds: int) -> int:
    """Enough KV for every site to hold the whole burst and its holds: the batch size, not the
    cache, limits each site (as in MICO's Table 1), and the gateway's KV bound never turns a
    query away."""
    loaded = load_model(model_dir)
    spec = KVCacheSpec.from_config(loaded.model.config)
    per_token = kv_cache_bytes_per_block(spec, BLOCK_SIZE, loaded.dtype) / BLOCK_SIZE
    tokens = workload_tokens + most_holds * MAX_MODEL_LEN
    return max(16, math.ceil(1.25 * tokens * per_token / (1 << 20)))


def predictions_used(options: Options) -> dict[str, object]:
    if options.predictor_dir is not None:
        return {
            "mode": "real",
            "artifact": str(options.predictor_dir),
            "note": "the gateway's length predictor; each prediction is capped at max_tokens "
            "(the true length in this replay), so over-predictions are clipped",
        }
    return {
        "mode": "none",
        "artifact": None,
        "note": "no predictor artifact (make predictor-default builds one): the gateways plan "
        "with max_tokens, which in this replay is the true answer length, so the "
        "token-balanced columns are oracle-informed",
    }


PROMPT_ONLY = {"GATEWAY_PLAN_WITHOUT_PREDICTION": "prompt_only"}


def extras_for(options: Options, max_batch: int) -> list[Extra]:
    """The batch-API columns everywhere; the ablation's arms in the ablation cell."""
    extras = [
        Extra("tok_static_batch", "mico", STATIC_MODEL, submission="batch", shares="mico"),
        Extra("mico_batch", "mico", ITER_MODEL, submission="batch", shares="mico"),
    ]
    if "ablation" not in options.phases or max_batch != options.ablation_max_batch:
        return extras
    cell = frozenset({options.ablation_sites})
    extras.append(Extra("least_requests", "least_requests", ITER_MODEL, site_counts=cell))
    # No predictor: routing weighs the prompts alone (in this replay max_tokens is the true
    # length, so planning with it would be the oracle).
    extras += [
        Extra(
            "mico_prompt_only",
            "mico",
            ITER_MODEL,
            with_predictor=False,
            site_counts=cell,
            env=PROMPT_ONLY,
        ),
        Extra(
            "mico_batch_prompt_only",
            "mico",
            ITER_MODEL,
            submission="batch",
            shares="mico_prompt_only",
            site_counts=cell,
        ),
    ]
    if options.predictor_dir is not None:  # else "mico" already plans with the true lengths
        extras += [
            Extra("mico_oracle", "mico", ITER_MODEL, with_predictor=False, site_counts=cell),
            Extra(
                "mico_batch_oracle",
                "mico",
                ITER_MODEL,
                submission="batch",
                shares="mico_oracle",
                site_counts=cell,
            ),
        ]
    return extras


def run(options: Options, command: str) -> Path:
    started = time.perf_counter()
    options.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(options.work_dir, options.tokenizer_dir)
    tokenizer = load_tokenizer(model_dir)
    workload = load_workload(
        max(options.queries, options.scenario_queries),
        tokenizer.encode,
        max_total_tokens=MAX_MODEL_LEN,
        seed=options.seed,
        data_dir=options.data_dir,
        answer_cap=options.answer_cap,
    )
    table_queries = workload.queries[: options.queries]
    scenario_queries = workload.queries[: options.scenario_queries]
    total = sum(q.total_tokens for q in workload.queries)
    most_holds = 2 * max(*(batch for batch, _ in options.grid), options.scenario_max_batch)
    cluster = Cluster(options.work_dir, model_dir, kv_cache_mib(model_dir, total, most_holds))
    bench = Bench(cluster, options.predictor_dir, log, MAX_MODEL_LEN, hold=options.hold)
    dead = [SiteSpec("nowhere-1", DEAD_MODEL, "fcfs", 1, free_port())]
    batch_limit = max(64, options.queries, options.scenario_queries)
    env = {
        "GATEWAY_BATCH_MAX_ITEMS": str(batch_limit),
        "GATEWAY_BATCH_SITE_CONCURRENCY": str(BATCH_SITE_CONCURRENCY),
    }
    results = Results(options, command, predictions_used(options))
    results.workload = Workload(table_queries, workload.skipped_too_long, workload.answer_cap)

    def checks(gateway: Gateway, live_model: str) -> None:
        if "bad_input" in options.phases and results.bad_input is None:
            log("bad input checks")
            results.bad_input = run_checks(gateway.base_url, live_model, DEAD_MODEL, batch_limit)

    try:
        if "table1" in options.phases:
            results.cells = _table1(
                bench,
                options,
                table_queries,
                dead,
                env,
                lambda gateways: checks(gateways["round_robin"], ITER_MODEL),
            )
        if "scenarios" in options.phases:
            settings = ScenarioSettings(options.scenario_max_batch)
            order = skewed(Workload(scenario_queries, 0, None), 0.1, 4, options.seed)
            results.scenarios, gateways = run_scenarios(
                bench, settings, scenario_queries, order.queries, dead, env
            )
            checks(gateways["rr"], EQUAL_MODEL)
    finally:
        stop_all()
        cluster.close()
    results.batch_api = bench.batch_api
    if "decision" in options.phases:
        log(f"timing {options.decisions} routing decisions per policy at 9 sites")
        results.decisions = time_decisions(9, options.decisions, options.seed)
    results.elapsed_s = time.perf_counter() - started
    return write(results)


def _table1(
    bench: Bench,
    options: Options,
    queries: Sequence[Query],
    dead: list[SiteSpec],
    env: dict[str, str],
    on_gateways: Callable[[dict[str, Gateway]], None],
) -> list[Cell]:
    """Every batch size; `on_gateways` gets the first one's gateways before they stop."""
    cells: list[Cell] = []
    for index, (max_batch, site_counts) in enumerate(options.grid):
        cells += run_batch_size(
            bench,
            max_batch,
            site_counts,
            queries,
            extras=extras_for(options, max_batch),
            dead_sites=dead,
            env={**NO_OFFLOAD, **env},
            on_gateways=on_gateways if index == 0 else None,
        )
    return cells


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    args = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "bench.multisite", *args])
    path = run(options, command)
    log(f"wrote {path} and {path.with_suffix('.md')}")
