"""Batch orders on one engine: the same offline batch run in the order each batch plan gives
(gateway/batches/plan.py), over four mixes after BlendServe's Table 2.

    python -m bench.engine.batch_order                (GPU: batch_order_<gpu>.json and .md)
    python -m bench.engine.batch_order --preset cpu   (CPU smoke: batch_order_cpu.json, .md)

Results go to bench/results/batch_order/ (bench.common.results_dir).

Mixes (bench/engine/batch_order_workload.py): two compute densities (1.4 and 0.9 by the plan's
roofline) x 5% / 35% of prompt tokens shared, from the development datasets. Orders:
`submission` (as submitted, random), `longest_first` (the longest predicted answer first: the
gateway's order before issue 52), `dfs` (depth-first by prompt prefix, SGLang lpm-like),
`blend_predicted` (BlendServe's order on predicted lengths: what the gateway runs) and
`blend_true` (the same on the true lengths: the predictor's cost). Every item runs with its true
length forced (`ignore_eos`), greedy; the engine is fed in order, as the gateway's feed does,
keeping at most `window` requests in it; each order starts from an empty prefix cache.

A scarce device (bench/engine/issue52_gpu.sh): `--order-seconds T` sizes each mix so that one
order runs about T seconds: a probe of `--probe-s` seconds feeds the mix (at the preset's size,
submission order) and measures the engine's prompt + answer tokens per second; the mix is then
built again with as many items as that rate finishes in T seconds (the same construction: group
size, sharing and density targets). `--deadline-s` skips the orders that would end past it
(listed under "skipped"). Both are written into the results, so a reduced run says so.

Keys: `throughput_vs_best_other` (mix -> blend_predicted tokens/s over the best of submission,
longest_first and dfs) and `prefix_sharing_vs_dfs` (mix -> blend_predicted's prefix-cache hit
tokens over dfs's). Tokens/s counts prompt and answer tokens over the run's wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, results_dir, write_results
from bench.engine.batch_order_report import ORDERS, OTHERS, markdown, plot, replot
from bench.engine.batch_order_workload import (
    MIXES,
    Item,
    build_mix,
    load_pools,
    mix_facts,
)
from bench.engine.engine_runs import warm_up
from bench.engine.harness import Progress
from bench.engine.model_setup import LLAMA_8B_8K_SHAPE, SMALL_SHAPE, preset_model
from bench.engine.paths import resolve_data_dir
from bench.engine.prefix import build_engine, device_label
from bench.engine.report import versions
from fedllm_contract.block_hash import prompt_block_hashes
from gateway.batch_settings import BatchOrder
from gateway.batches.blend import Roofline
from gateway.batches.plan import PlanItem, item_order
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import PagedEngine

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        "shape": LLAMA_8B_8K_SHAPE,
        "device": "cuda",
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "kv_cache_gib": 0.0,  # what the GPU has after the weights and a trial step
        "host_kv_cache_gib": 0.0,
        "items": 4000,
        "dense_prompt": (512, 2048),
        "short_answer": (8, 128),
        "sparse_prompt": (8, 256),
        "long_answer": (256, 2048),
        "max_answer": 2048,  # the clients' max_tokens: what a missing prediction plans
        "group_size": 50,
        "max_system_prompt": 2048,
        "window": 512,
        "pool_limit": 4000,
        # The plan's roofline (GATEWAY_BATCH_BLEND_*): Llama-3-8B on an H100.
        "model_params_b": 8.0,
    },
    "cpu": {
        "shape": {
            **SMALL_SHAPE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 1024,
        },
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "block_size": 16,
        "kv_cache_blocks": 512,
        "host_kv_blocks": 0,
        "items": 24,
        "dense_prompt": (96, 256),
        "short_answer": (1, 4),
        "sparse_prompt": (8, 32),
        "long_answer": (12, 32),
        "max_answer": 64,
        "group_size": 10,
        "max_system_prompt": 128,
        "window": 16,
        "pool_limit": 300,
        # A roofline scaled to the smoke's tiny lengths, so that its mixes span both densities
        # (with an 8B model every request this short would be compute-dense).
        "model_params_b": 0.2,
    },
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.batch_order", description=__doc__)
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    add("--mixes", default=",".join(MIXES), help=f"comma-separated, of {tuple(MIXES)}")
    add("--orders", default=",".join(ORDERS), help=f"comma-separated, of {ORDERS}")
    add("--items", type=int, default=None, help="requests per mix")
    add("--model-dir", type=Path, default=None, help="built there first if empty")
    add("--tokenizer-dir", type=Path, default=None, help="default: ../shared/tokenizers/gpt2")
    add("--data-dir", type=Path, default=None, help="default: FEDLLM_DATA_DIR, ../shared/datasets")
    add("--results-dir", type=Path, default=results_dir("batch_order"))
    add("--name", default=None, help="default: batch_order_<device>")
    add("--seed", type=int, default=0)
    add(
        "--order-seconds",
        type=float,
        default=None,
        help="size each mix so that one order runs about this long (a probe measures the rate)",
    )
    add("--probe-s", type=float, default=8.0, help="seconds of the rate probe of each mix")
    add("--deadline-s", type=float, default=None, help="skip orders that would end past it")
    add("--replot", type=Path, default=None, help="only write the MD and PNG of this JSON again")
    args = parser.parse_args(argv)
    for key in ("order_seconds", "probe_s", "deadline_s"):
        value = getattr(args, key)
        if value is not None and value <= 0:
            parser.error(f"--{key.replace('_', '-')} must be > 0")
    args.p = dict(PRESETS[args.preset])
    if args.items is not None:
        args.p["items"] = args.items
    args.mixes = [m for m in args.mixes.split(",") if m]
    args.orders = [o for o in args.orders.split(",") if o]
    if set(args.mixes) - set(MIXES) or set(args.orders) - set(ORDERS):
        parser.error("unknown mix or order")
    return args


def plan_order(
    order: str, items: Sequence[Item], ids: Sequence[tuple[int, ...]], p: dict[str, Any]
) -> list[int]:
    """The batch plan's order of the items (gateway/batches/plan.item_order)."""
    plan = [
        PlanItem(
            index,
            len(item.prompt),
            p["max_answer"],
            item.predicted_tokens,
            block_ids=ids[index],
            true_tokens=item.true_tokens if order == "blend_true" else None,
        )
        for index, item in enumerate(items)
    ]
    name: BatchOrder = "blend" if order.startswith("blend") else order  # type: ignore[assignment]
    return [plan[pos].index for pos in item_order(plan, name, roofline(p), p["block_size"])]


def roofline(p: dict[str, Any]) -> Roofline:
    return Roofline(model_params=p["model_params_b"] * 1e9)


def run_order(
    engine: PagedEngine, items: Sequence[Item], order: Sequence[int], window: int, label: str
) -> dict[str, Any]:
    """Feeds the items in `order`, at most `window` in the engine at a time, until all end."""
    engine.restart_scheduler(prefix_caching=True, host_tier=False)
    before = engine.stats()
    pending, live, generated = list(reversed(order)), 0, 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and live < window:
            index = pending.pop()
            item = items[index]
            sampling = SamplingParams(max_tokens=item.true_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(EngineRequest(f"{label}-{index}", item.prompt, sampling))
            live += 1
        for output in engine.step():
            generated += len(output.new_token_ids)
            if output.finish_reason is not None:
                live -= 1
    elapsed = time.perf_counter() - start
    after = engine.stats()
    prompt = sum(len(items[i].prompt) for i in order)
    hits = int(after.prefix_cache_hits - before.prefix_cache_hits)
    queries = int(after.prefix_cache_queries - before.prefix_cache_queries)
    return {
        "elapsed_s": round(elapsed, 3),
        "tokens_s": round((prompt + generated) / elapsed, 1),
        "output_tok_s": round(generated / elapsed, 1),
        "prompt_tokens": prompt,
        "output_tokens": generated,
        "prefix_hit_tokens": hits,
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "prompt_tokens_computed": int(after.prompt_tokens_computed - before.prompt_tokens_computed),
    }


def probe_rate(engine: PagedEngine, items: Sequence[Item], window: int, seconds: float) -> float:
    """Prompt + answer tokens per second the engine gets through when fed `items` in their
    (submission) order for `seconds`; what is left is cancelled. Prompt tokens count whether
    computed or found in the prefix cache, as run_order's tokens/s counts them."""
    engine.restart_scheduler(prefix_caching=True, host_tier=False)
    before = engine.stats()
    pending, live, generated, ids = list(range(len(items)))[::-1], 0, 0, []
    start = time.perf_counter()
    while (pending or engine.has_unfinished()) and time.perf_counter() - start < seconds:
        while pending and live < window:
            index = pending.pop()
            item = items[index]
            sampling = SamplingParams(max_tokens=item.true_tokens, temperature=0.0, ignore_eos=True)
            ids.append(f"probe-{index}")
            engine.add_request(EngineRequest(ids[-1], item.prompt, sampling))
            live += 1
        for output in engine.step():
            generated += len(output.new_token_ids)
            live -= output.finish_reason is not None
    elapsed = time.perf_counter() - start
    after = engine.stats()
    for request_id in ids:
        engine.abort(request_id, FinishReason.CANCELLED)  # False for finished ones
    while engine.has_unfinished():
        engine.step()
    prompt = (after.prompt_tokens_computed - before.prompt_tokens_computed) + (
        after.prefix_cache_hits - before.prefix_cache_hits
    )
    return (prompt + generated) / max(elapsed, 1e-9)


def items_for(items: Sequence[Item], tokens: float) -> int:
    """How many items like `items`, taken in order, hold `tokens` prompt + answer tokens (at
    least 1): past their end, extrapolated at their mean."""
    total = 0
    for count, item in enumerate(items, 1):
        total += len(item.prompt) + item.true_tokens
        if total >= tokens:
            return count
    return max(len(items), math.ceil(len(items) * tokens / max(total, 1)))


def summarize(mixes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    vs_best: dict[str, float | None] = {}
    vs_dfs: dict[str, float | None] = {}
    for name, mix in mixes.items():
        rows = mix["orders"]
        blend = rows.get("blend_predicted")
        others = [rows[o]["tokens_s"] for o in OTHERS if o in rows]
        vs_best[name] = round(blend["tokens_s"] / max(others), 3) if blend and others else None
        dfs = rows.get("dfs")
        vs_dfs[name] = (
            round(blend["prefix_hit_tokens"] / dfs["prefix_hit_tokens"], 3)
            if blend and dfs and dfs["prefix_hit_tokens"]
            else None
        )
    return {"throughput_vs_best_other": vs_best, "prefix_sharing_vs_dfs": vs_dfs}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot is not None:
        replot(args.replot)
        return
    p, log = args.p, Progress()
    loaded = preset_model(
        p, args.model_dir, args.tokenizer_dir, log, f"batch-order-{args.preset}", args.seed
    )
    engine = build_engine(loaded, p)
    warm_up(engine, len(loaded.tokenizer), 4, args.seed)
    tokenizer = loaded.tokenizer
    pools = load_pools(
        resolve_data_dir(args.data_dir), lambda text: list(tokenizer.encode(text)), p["pool_limit"]
    )
    roof = roofline(p)
    mixes: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    name = args.name or f"batch_order_{device_label(loaded)}"

    def save(complete: bool) -> Path:
        """Written after every order, so that a run cut short keeps what it measured."""
        payload: dict[str, Any] = {
            "preset": args.preset,
            "complete": complete,
            "versions": versions(),
            "model": {"shape": p["shape"], "dtype": p["dtype"], "device": str(loaded.device)},
            "workload": {k: v for k, v in p.items() if k != "shape"},
            "sizing": sizing(args),
            "skipped": skipped,
            "roofline": {
                "peak_flops": roof.peak_flops,
                "memory_bytes_per_s": roof.memory_bytes_per_s,
                "model_params": roof.model_params,
                "kv_bytes_per_token": roof.kv_bytes_per_token,
            },
            "prediction": "true length x lognormal error (sigma 0.5, seeded): stands for the "
            "length predictor",
            "mixes": mixes,
        }
        payload.update(summarize(mixes))
        command = command_line("bench.engine.batch_order", argv)
        path = write_results(name, payload, markdown(payload), command, args.results_dir)
        if importlib.util.find_spec("matplotlib") is not None:
            plot(payload, path.with_suffix(".png"))
        return path

    for mix in args.mixes:
        items = build_mix(mix, pools, p, roof, args.seed)
        probe: dict[str, Any] = {}
        if args.order_seconds is not None:
            rate = probe_rate(engine, items, p["window"], args.probe_s)
            count = items_for(items, rate * args.order_seconds)
            probe = {"tokens_s": round(rate, 1), "preset_items": len(items), "items": count}
            items = build_mix(mix, pools, {**p, "items": count}, roof, args.seed)
            log(f"mix {mix}: probe {probe}")
        ids = [tuple(prompt_block_hashes(i.prompt, p["block_size"], "bench")) for i in items]
        facts = mix_facts(items, roof, ids, p["block_size"])
        mixes[mix] = {"facts": facts, "probe": probe, "orders": {}}
        log(f"mix {mix}: {facts}")
        for order in args.orders:
            expected = args.order_seconds or 0.0
            if args.deadline_s is not None and log.elapsed() + expected > args.deadline_s:
                skipped.append(f"{mix}/{order}")
                log(f"  {order}: skipped (deadline {args.deadline_s} s)")
                continue
            row = run_order(engine, items, plan_order(order, items, ids, p), p["window"], order)
            mixes[mix]["orders"][order] = row
            log(f"  {order}: {row['tokens_s']} tokens/s in {row['elapsed_s']} s, hit rate "
                f"{row['prefix_hit_rate']}")  # fmt: skip
            save(complete=False)
    log(f"wrote {save(complete=not skipped)}")


def sizing(args: argparse.Namespace) -> str:
    """How the run was sized, for the results: the preset's, or reduced to fit a device slot."""
    if args.order_seconds is None:
        return f"preset: {args.p['items']} items a mix, each order run to its end"
    return (
        f"reduced to fit the device time: each mix sized by a {args.probe_s:g} s rate probe so "
        f"that one order runs about {args.order_seconds:g} s, instead of the preset's "
        f"{args.p['items']} items a mix each run to its end (the issue asks >= 4,000 items and "
        ">= 60 s an order)" + (f"; deadline {args.deadline_s:g} s" if args.deadline_s else "")
    )


if __name__ == "__main__":
    main()
