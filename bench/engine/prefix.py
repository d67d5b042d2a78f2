"""Prefix caching on one engine: caching off, the device cache, and the device cache with a host
tier, in one run, over three workloads at five or more open-loop arrival rates each.

    python -m bench.engine.prefix               (GPU: bench/results/engine_prefix/*_h100.*)
    python -m bench.engine.prefix --preset cpu  (CPU: bench/results/engine_prefix/*_cpu.*)
    python -m bench.engine.prefix --preset hosttier   (GPU, ~6 min: the trace with and without
        the host tier, a device cache the trace overflows; issue 50's host_tier_ttft_p99_ratio)

Workloads (bench/engine/prefix_workloads.py): `shared` (MT-Bench two-turn conversations behind
a common system prompt), `trace` (the synthetic Mooncake trace, all of it, once per arm, its
consecutive parts at ascending rates; the cache carries from part to part), `noreuse`
(ShareGPT-shaped prompts of random tokens). The arms run on one engine, built once (CUDA graphs
captured once); each arm starts with an empty cache (PagedEngine.restart_scheduler), `shared`
and `noreuse` at every rate, `trace` once. Per run: prompt tokens offered and computed, hits per
tier, TTFT p50/p99, TPOT p99, output tok/s; per workload and arm the goodput, the highest rate
holding the SLO (TTFT p99 <= 2 s, TPOT p99 <= 100 ms, every request finished). The trace's
reuse is compared with what a single LRU cache of the capacity the engine ran with could reach.

The CPU preset (a tiny model) runs on a step clock (prefix_driver.py): its prompt tokens computed
are deterministic, and tests/unit/engine/test_bench_prefix_cpu.py checks them against the
committed results. The GPU preset fits one device command of under nine minutes, model setup
and warm-up included: rates and windows are sized for that, and a deadline skips what would not
end in time (listed under "skipped").
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line
from bench.engine.engine_runs import warm_up
from bench.engine.harness import GIB, Deadline, Progress
from bench.engine.model_setup import LLAMA_1B_SHAPE, ensure_model
from bench.engine.paths import shared_path
from bench.engine.prefix_driver import Slo, drive, goodput, meets
from bench.engine.prefix_report import save
from bench.engine.prefix_workloads import (
    Session,
    TraceTokens,
    load_mt_bench,
    lru_bound,
    noreuse_sessions,
    shared_sessions,
    trace_parts,
    trace_sessions,
)
from bench.engine.presets import (
    TokenClock,
    WallClock,
    chosen,
    device_label,
    kv_bytes,
    preset_parser,
)
from bench.engine.report import versions
from bench.loadgen.traces import read_trace
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

ARMS = ("off", "device", "host")
WORKLOADS = ("shared", "trace", "noreuse")
PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        "shape": {**LLAMA_1B_SHAPE, "max_position_embeddings": 8192},
        "device": "cuda",
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "kv_cache_gib": 0.0,  # what the GPU has after the weights and a trial step
        "host_kv_cache_gib": 16.0,
        "system_tokens": 4096,
        "shared_rates": [16.0, 32.0, 48.0, 64.0, 96.0, 128.0, 160.0, 192.0],
        "shared_answers": (64, 192),
        "window_s": 3.0,
        "drain_s": 8.0,
        "trace_requests": None,  # all 3,993
        "trace_cap": 2048,
        "trace_answer_cap": 32,
        "trace_rates": [48.0, 56.0, 64.0, 72.0, 80.0],
        "noreuse_rates": [16.0, 32.0, 64.0, 96.0, 128.0],
        "noreuse_arms": ("off", "device"),
        "max_prompt": 2048,
        "max_answer": 256,
        "clock_step_s": None,  # wall clock
        "deadline_s": 500.0,
    },
    # The host tier against the device cache alone on the trace (issue 50), in ~6 minutes of
    # one H100: an 8 GiB device cache (16,384 blocks, 262k tokens; the trace's inputs cut at
    # 2,048 reuse ~1M tokens, so the device alone can reach 0.70 computed/offered, with the
    # 16 GiB tier 0.56 at best), no caching-off arm, and three parts of the trace (1,331
    # requests each, 37, 30 and 26 s of arrivals) at rates around the knee; the deadline leaves
    # ~2.5 minutes for the model build, warm-up and the LRU bounds.
    "hosttier": {
        "shape": {**LLAMA_1B_SHAPE, "max_position_embeddings": 8192},
        "device": "cuda",
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "kv_cache_gib": 8.0,
        "host_kv_cache_gib": 16.0,
        "system_tokens": 4096,
        "shared_rates": [],
        "shared_answers": (64, 192),
        "window_s": 3.0,
        "drain_s": 8.0,
        "trace_requests": None,  # all 3,993
        "trace_cap": 2048,
        "trace_answer_cap": 32,
        "trace_rates": [36.0, 44.0, 52.0],
        "trace_arms": ("device", "host"),
        "noreuse_rates": [],
        "noreuse_arms": ("off", "device"),
        "max_prompt": 2048,
        "max_answer": 256,
        "clock_step_s": None,
        "deadline_s": 420.0,
        "workloads": ("trace",),
    },
    "cpu": {
        "shape": {
            **LLAMA_1B_SHAPE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 50304,
            "max_position_embeddings": 2048,
        },
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "block_size": 16,
        "kv_cache_blocks": 1024,
        "host_kv_blocks": 4096,
        "system_tokens": 512,
        "shared_rates": [4.0, 8.0, 16.0, 32.0, 64.0],
        "shared_answers": (4, 12),
        "window_s": 2.0,
        "drain_s": 30.0,
        # The trace's last 600 requests: the late turns of its conversations reuse the most.
        "trace_requests": 600,
        "trace_cap": 1024,
        "trace_answer_cap": 4,
        "trace_rates": [2.0, 4.0, 8.0, 16.0, 32.0],
        "noreuse_rates": [2.0, 4.0, 8.0, 16.0, 32.0],
        "noreuse_arms": ("off", "device"),
        "max_prompt": 512,
        "max_answer": 16,
        "clock_step_s": 0.02,
        "deadline_s": 900.0,
    },
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser, add = preset_parser(
        "bench.engine.prefix", __doc__, PRESETS, "engine_prefix", "deadline_s"
    )
    add("--workloads", default=None, help=f"comma-separated, of {WORKLOADS} (default: all)")
    add("--traces-dir", type=Path, default=None, help="default: ../shared/datasets/traces")
    add("--host-kv-cache-gib", type=float, default=None)
    add("--host-kv-offload-bytes-per-step", type=int, default=None, help="default: the site's")
    add("--trace-requests", type=int, default=None, help="the trace's last N requests (0: all)")
    add("--shared-rates", type=float, nargs="+", default=None, help="conversations/s")
    add("--trace-cap", type=int, default=None, help="input tokens kept of each trace request")
    add("--trace-rates", type=float, nargs="+", default=None, help="requests/s, one per part")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    keys = ("host_kv_cache_gib", "host_kv_offload_bytes_per_step", "deadline_s")
    args.p = chosen(args, PRESETS, *keys)
    if args.trace_requests is not None:
        args.p["trace_requests"] = args.trace_requests or None
    if args.shared_rates:
        args.p["shared_rates"] = sorted(args.shared_rates)
    if args.trace_rates:
        args.p["trace_rates"] = sorted(args.trace_rates)
    if args.trace_cap is not None:
        if args.trace_cap < 1:
            parser.error("--trace-cap must be positive")
        args.p["trace_cap"] = args.trace_cap
    default_workloads = ",".join(args.p.get("workloads", WORKLOADS))
    args.workloads = [w for w in (args.workloads or default_workloads).split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}")
    return args


def build_engine(loaded: LoadedModel, p: dict[str, Any]) -> PagedEngine:
    if "kv_cache_blocks" in p:
        size = p["block_size"]
        device = kv_bytes(loaded, p["kv_cache_blocks"], size)
        host = kv_bytes(loaded, p["host_kv_blocks"], size)
    else:
        device, host = int(p["kv_cache_gib"] * GIB), int(p["host_kv_cache_gib"] * GIB)
    # The site's default bandwidth share unless the run names one.
    offload = {k: p[k] for k in ("host_kv_offload_bytes_per_step",) if p.get(k) is not None}
    return PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=p["max_num_seqs"],
            max_num_batched_tokens=p["max_num_batched_tokens"],
            block_size=p["block_size"],
            kv_cache_bytes=device,
            host_kv_cache_bytes=host,
            **offload,
            model_name="bench",
        ),
    )


class Runner:
    """Runs (workload, arm, rate) on the one engine and keeps the rows and what was skipped."""

    def __init__(self, engine: PagedEngine, p: dict[str, Any], log: Progress) -> None:
        self.engine = engine
        self.p = p
        self.log = log
        self.deadline = Deadline(log, p["deadline_s"])
        self.slo = Slo()
        self.skipped: list[str] = []
        self.host_slots = engine.runner.host_kv.num_slots if engine.runner.host_kv else 0
        self.arms = ARMS if self.host_slots else ARMS[:2]

    def arm(self, name: str) -> None:
        self.engine.restart_scheduler(prefix_caching=name != "off", host_tier=name == "host")

    def run(self, label: str, sessions: list[Session], rate: float) -> dict[str, Any] | None:
        last = max(s.arrival_s for s in sessions)
        budget = last + self.p["drain_s"]
        step = self.p["clock_step_s"]
        if step is None and self.deadline.budget(budget, 0) < budget:
            self.skipped.append(label)
            self.log(f"  {label} skipped: the run's deadline is near")
            return None
        clock = TokenClock(step) if step is not None else WallClock()
        row = drive(self.engine, sessions, clock, budget, label)
        row["rate"] = rate
        row["misses"] = meets(row, self.slo)
        self.log(
            f"  {label}: computed/offered {_f(row['prefill_computed_over_offered'])}, hits "
            f"{_f(row['hit_rate'])} (host {_f(row['host_hit_rate'])}), TTFT p50/p99 "
            f"{_f(row['ttft_p50_ms'], 0)}/{_f(row['ttft_p99_ms'], 0)} ms, TPOT p99 "
            f"{_f(row['tpot_p99_ms'], 1)} ms, {_f(row['output_tok_s'], 0)} tok/s"
            + (f"; misses: {', '.join(row['misses'])}" if row["misses"] else "")
        )
        return row

    def sweep(
        self,
        workload: str,
        arm: str,
        rates: Sequence[float],
        make: Callable[[float], list[Session]],
    ) -> list[dict[str, Any]]:
        """Each rate from an empty cache, until two rates in a row miss the SLO."""
        rows: list[dict[str, Any]] = []
        for rate in rates:
            if len(rows) >= 2 and rows[-1]["misses"] and rows[-2]["misses"]:
                self.skipped.append(f"{workload}/{arm}@{rate:g} (two rates missed before)")
                continue
            self.arm(arm)
            row = self.run(f"{workload}/{arm}@{rate:g}", make(rate), rate)
            if row is not None:
                rows.append(row)
        return rows


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def combined(rows: Sequence[dict[str, Any]]) -> float | None:
    offered = sum(r["offered_prompt_tokens"] for r in rows)
    return sum(r["prompt_tokens_computed"] for r in rows) / offered if offered else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def traces_dir(args: argparse.Namespace) -> Path:
    return Path(args.traces_dir or shared_path(None, "datasets", "traces"))


def run_shared(runner: Runner, args: argparse.Namespace, encode: Any, vocab: int) -> dict[str, Any]:
    p = runner.p
    questions = load_mt_bench(traces_dir(args) / "mt_bench_question.jsonl", encode)

    def make(rate: float) -> list[Session]:
        return shared_sessions(
            questions, system_tokens=p["system_tokens"], vocab=vocab, rate=rate,
            window_s=p["window_s"], answers=p["shared_answers"], seed=args.seed,
        )  # fmt: skip

    arms = {arm: runner.sweep("shared", arm, p["shared_rates"], make) for arm in runner.arms}
    good = {arm: goodput(rows) for arm, rows in arms.items()}
    return {
        "rates_unit": "conversations/s (two turns each)",
        "arms": arms,
        "goodput": good,
        "prefill_computed_over_offered": combined(arms["device"]),
        "host_prefill_computed_over_offered": combined(arms.get("host", [])),
        "goodput_vs_no_cache": ratio(good["device"], good["off"]),
        "host_goodput_vs_no_cache": ratio(good.get("host"), good["off"]),
    }


def run_trace(runner: Runner, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    p = runner.p
    rows = read_trace(traces_dir(args) / "mooncake_fast25_synthetic_trace.jsonl")
    first = len(rows) - p["trace_requests"] if p["trace_requests"] else 0
    rows = rows[first:]
    parts = trace_parts(rows, len(p["trace_rates"]))
    tokens = TraceTokens(vocab)
    arms: dict[str, list[dict[str, Any]]] = {}
    for arm in [a for a in runner.arms if a in p.get("trace_arms", ARMS)]:
        runner.arm(arm)  # one cache for the whole trace: it carries from part to part
        arms[arm] = []
        for k, (part, rate) in enumerate(zip(parts, p["trace_rates"], strict=False)):
            sessions, speedup = trace_sessions(
                part, tokens, rate=rate, cap=p["trace_cap"], max_answer=p["trace_answer_cap"],
                label=f"part{k}",
            )  # fmt: skip
            row = runner.run(f"trace/{arm}@{rate:g} (part {k + 1})", sessions, rate)
            if row is not None:
                row["part"], row["trace_speedup"] = k + 1, speedup
                arms[arm].append(row)
    limits = runner.engine.limits
    device_tokens = limits.kv_blocks_total * limits.kv_block_size
    host_tokens = runner.host_slots * limits.kv_block_size
    cap, size = p["trace_cap"], limits.kv_block_size
    bounds = {
        "device": lru_bound(rows, cap, device_tokens, size),
        "device_and_host": lru_bound(rows, cap, device_tokens + host_tokens, size),
        "unbounded": lru_bound(rows, cap, math.inf, size),
    }
    good = {arm: goodput(r) for arm, r in arms.items()}
    device_bound = bounds["device"]["computed_over_offered"]
    host_bound = bounds["device_and_host"]["computed_over_offered"]
    return {
        "requests": len(rows),
        "first_request": first,
        "input_cap_tokens": cap,
        "answer_cap_tokens": p["trace_answer_cap"],
        "how": (
            f"requests {first}-{first + len(rows) - 1} of the trace (of 3,993), in order; each "
            "hash id -> 512 seeded tokens; inputs cut "
            f"to {cap} tokens (the model's context is {runner.engine.limits.max_model_len}), "
            f"answers to {p['trace_answer_cap']}; the trace is cut into {len(parts)} consecutive "
            "parts replayed at the rates below (its own arrival times, shifted to 0 and sped up "
            "to that mean rate); each arm replays all parts on one cache"
        ),
        "arms": arms,
        "goodput": good,
        "lru_bounds": bounds,
        "prefill_computed_over_offered": {arm: combined(r) for arm, r in arms.items()},
        "computed_over_lru_bound": ratio(combined(arms["device"]), device_bound),
        "host_computed_over_lru_bound": ratio(combined(arms.get("host", [])), host_bound),
        "host_tier_computed_over_offered": combined(arms.get("host", [])),
        "goodput_vs_no_cache": ratio(good["device"], good.get("off")),
        "host_goodput_vs_no_cache": ratio(good.get("host"), good.get("off")),
        **host_tier_cost(arms),
    }


def host_tier_cost(arms: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Issue 50's keys: the host arm's TTFT p99 over the device arm's at each rate (<= 1.0: the
    tier never costs the step) and their goodputs' ratio."""
    device = {r["rate"]: r for r in arms.get("device", [])}
    ratios = {
        f"{r['rate']:g}": ratio(r["ttft_p99_ms"], device[r["rate"]]["ttft_p99_ms"])
        for r in arms.get("host", [])
        if r["rate"] in device
    }
    known = [v for v in ratios.values() if v is not None]
    if not ratios:
        return {}
    return {
        "host_tier_ttft_p99_ratio": ratios,
        "host_tier_ttft_p99_ratio_max": max(known) if known else None,
        "host_goodput_vs_device": ratio(goodput(arms["host"]), goodput(arms["device"])),
    }


def run_noreuse(runner: Runner, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    p = runner.p

    def make(rate: float) -> list[Session]:
        return noreuse_sessions(
            vocab=vocab, rate=rate, window_s=p["window_s"], max_prompt=p["max_prompt"],
            max_answer=p["max_answer"], seed=args.seed,
        )  # fmt: skip

    arms = {
        arm: runner.sweep("noreuse", arm, p["noreuse_rates"], make) for arm in p["noreuse_arms"]
    }
    peak = {
        arm: max((r["output_tok_s"] or 0.0 for r in rows), default=None)
        for arm, rows in arms.items()
    }
    return {
        "arms": arms,
        "goodput": {arm: goodput(rows) for arm, rows in arms.items()},
        "peak_output_tok_s": peak,
        "throughput_vs_no_cache_no_reuse": ratio(peak.get("device"), peak.get("off")),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    p, log = args.p, Progress()
    if p["device"] == "cpu":
        torch.set_num_threads(1)
    model_dir = args.model_dir or Path(f"/tmp/fedllm-bench-prefix-{args.preset}")
    loaded = ensure_model(model_dir, p["shape"], args.tokenizer_dir, log, dtype=p["dtype"],
                          device=p["device"], seed=args.seed)  # fmt: skip
    engine = build_engine(loaded, p)
    warm_up(engine, len(loaded.tokenizer), 4, args.seed)
    limits = engine.limits
    host_slots = engine.runner.host_kv.num_slots if engine.runner.host_kv else 0
    log(
        f"engine: {limits.kv_blocks_total} blocks of {limits.kv_block_size} tokens on the "
        f"device, {host_slots} in the host tier"
    )
    tokenizer = loaded.tokenizer
    vocab = min(len(tokenizer), int(loaded.model.config.vocab_size))
    name = args.name or f"engine_prefix_{device_label(loaded)}"
    runner = Runner(engine, p, log)
    payload: dict[str, Any] = {
        "preset": args.preset,
        "complete": False,
        "versions": versions(),
        "engine": {
            "kv_blocks_total": limits.kv_blocks_total,
            "kv_block_size": limits.kv_block_size,
            "kv_block_bytes": limits.kv_block_bytes,
            "host_kv_blocks": host_slots,
            "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": p["max_num_batched_tokens"],
            "max_model_len": limits.max_model_len,
        },
        "model": {"shape": p["shape"], "dtype": p["dtype"], "device": str(loaded.device)},
        "slo": {"ttft_p99_ms": runner.slo.ttft_p99_ms, "tpot_p99_ms": runner.slo.tpot_p99_ms},
        "clock": "wall" if p["clock_step_s"] is None else f"step ({p['clock_step_s']} s/step)",
        "workloads": {},
    }
    command = command_line("bench.engine.prefix", argv)
    for workload in args.workloads:
        log(f"workload {workload}")
        if workload == "shared":
            result = run_shared(runner, args, lambda text: tokenizer.encode(text), vocab)
        elif workload == "trace":
            result = run_trace(runner, args, vocab)
        else:
            result = run_noreuse(runner, args, vocab)
        payload["workloads"][workload] = result
        payload["skipped"] = runner.skipped
        save(args, name, payload, command)
    payload["complete"] = True
    path = save(args, name, payload, command)
    log(f"results in {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
