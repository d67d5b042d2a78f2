"""Interactive chat next to queued batch work on one engine (issue 52): how much the batch class
hurts interactive latency, and how much of the idle capacity it fills.

    python -m bench.engine.priority               (GPU: bench/results/priority/priority_<gpu>.*)
    python -m bench.engine.priority --preset cpu  (CPU: bench/results/priority/priority_cpu.*)

Each seed (--seeds, three by default) draws its own arrivals, prompts and batch; the engine and
its capacity are measured once. The keys are the median over the seeds, with their minimum and
maximum beside them (`<key>_min`, `<key>_max`). The GPU preset is sized for a scarce device: 30 s
of arrivals and at most 10 s of drain a run, two runs a seed, ~4 minutes for three seeds after
the model is up.

Steps, on one warmed-up engine:
1. Capacity: a burst of interactive-shaped requests (all at once) gives the requests/s the
   engine finishes; a burst of batch-shaped ones gives its output tokens/s for batch work.
2. `alone`: interactive requests arrive as a Poisson process at `load` (0.5) x that capacity
   for `window_s`, then drain.
3. `with_batch`: the same arrivals while a batch of priority BATCH, larger than the engine can
   finish in the run, is queued at t=0: held by the driver as the gateway holds a batch, the
   engine's queue topped up to twice its sequence limit before every step.
Each run starts from an empty prefix cache: both replay the same prompts (priority_driver.drive).
Keys: `interactive_ttft_p99_ratio` and `interactive_tpot_p99_ratio` (with_batch / alone; goal
<= 1.2 each) and `batch_share_of_idle`: the batch's output tokens within the window over the
batch capacity the interactive load leaves, batch tok/s x window x (1 - load) (goal >= 0.8).

Prompts are random tokens (no prefix in common) of chat-like lengths; answers have exact lengths
(ignore_eos). The CPU preset (a tiny model) runs on a token clock (priority_driver.py) so its
figures do not depend on the shared CPU; the GPU preset (a Llama-3-8B-shaped random model in
bf16) on the wall clock.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from bench.common import command_line, markdown_table, write_results
from bench.engine.engine_runs import warm_up
from bench.engine.harness import GIB, Progress
from bench.engine.model_setup import LLAMA_8B_8K_SHAPE, preset_model
from bench.engine.presets import (
    Clock,
    TokenClock,
    WallClock,
    chosen,
    device_label,
    kv_bytes,
    preset_parser,
    tiny_shape,
)
from bench.engine.priority_driver import (
    RunResult,
    Shape,
    burst,
    drive,
    make_requests,
    poisson_arrivals,
)
from fedllm_contract.priority import Priority
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        "shape": LLAMA_8B_8K_SHAPE,
        "device": "cuda",
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "kv_cache_gib": 0.0,  # what the GPU has after the weights and a trial step
        "deferral_bound_tokens": 512,
        "deferral_bound_slack": 0.15,
        "interactive": Shape(prompt=(64, 768), answer=(32, 256)),
        "batch": Shape(prompt=(128, 1024), answer=(64, 384)),
        "burst_requests": 256,
        "window_s": 30.0,
        "drain_s": 10.0,
        "clock": None,  # the wall clock
    },
    "cpu": {
        "shape": tiny_shape(1024),
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "kv_cache_blocks": 192,
        # 3.2 ms of background prefill a step at most, a third of a step's fixed cost.
        "deferral_bound_tokens": 32,
        "deferral_bound_slack": 0.15,
        "interactive": Shape(prompt=(16, 96), answer=(8, 32)),
        "batch": Shape(prompt=(32, 128), answer=(16, 48)),
        "burst_requests": 48,
        "window_s": 20.0,
        "drain_s": 20.0,
        # A GPU-like step: 10 ms, plus 0.1 ms a token it computes.
        "clock": (0.010, 0.0001),
    },
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    runs = ("window_s", "drain_s", "burst_requests")
    parser, add = preset_parser("bench.engine.priority", __doc__, PRESETS, "priority", *runs)
    add("--load", type=float, default=0.5, help="interactive rate / interactive capacity")
    add("--deferral-bound-tokens", type=int, default=None, help="0: no bound")
    add("--deferral-bound-slack", type=float, default=None, help="0: no time bound")
    add("--seeds", default="0,1,2", help="comma-separated; each draws its own requests")
    args = parser.parse_args(argv)
    if not 0 < args.load < 1:
        parser.error("--load must be in (0, 1)")
    try:
        args.seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        parser.error("--seeds must name at least one seed, each once")
    args.p = chosen(args, PRESETS, *runs, "deferral_bound_tokens", "deferral_bound_slack")
    return args


def build_engine(loaded: LoadedModel, p: dict[str, Any]) -> PagedEngine:
    blocks = kv_bytes(loaded, p["kv_cache_blocks"]) if "kv_cache_blocks" in p else 0
    return PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=p["max_num_seqs"],
            max_num_batched_tokens=p["max_num_batched_tokens"],
            block_size=16,
            kv_cache_bytes=blocks or int(p["kv_cache_gib"] * GIB),
            # As a site runs by default: a preempted sequence finds its own full blocks again, so
            # preempting it for an interactive one costs the recompute of its last block only.
            prefix_caching=True,
            background_step_tokens=p["deferral_bound_tokens"],
            background_step_slack=p.get("deferral_bound_slack", 0.0),
            # On a token clock the driver reports each step's time (priority_driver.py).
            measure_step_time=p.get("clock") is None,
            # A site that takes fine-tuning jobs keeps their reserve out of the cache
            # (bench.engine.finetune_colocated).
            finetune_reserve_bytes=p.get("finetune_reserve_bytes", 0),
        ),
    )


def new_clock(p: dict[str, Any]) -> Clock:
    return TokenClock(*p["clock"]) if p["clock"] else WallClock()


def summary(run: RunResult) -> dict[str, Any]:
    ms = 1000.0
    ttft, tpot = run.p99(run.ttft_s), run.p99(run.tpot_s)
    median = run.percentile(run.ttft_s, 50)
    return {
        "interactive_requests": run.interactive_total,
        "interactive_finished": run.interactive_done,
        "ttft_p50_ms": median * ms if median is not None else None,
        "ttft_p99_ms": ttft * ms if ttft is not None else None,
        "tpot_p99_ms": tpot * ms if tpot is not None else None,
        "interactive_tokens_in_window": run.interactive_tokens_in_window,
        "interactive_cached_prompt_tokens": run.interactive_cached_prompt_tokens,
        "batch_tokens_in_window": run.batch_tokens_in_window,
        "preemptions": run.preemptions,
        "steps": run.steps,
        "clock_s": run.clock_s,
        "step_cost_s": list(run.step_cost_s),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def capacity(
    engine: PagedEngine, loaded: LoadedModel, args: argparse.Namespace, log: Progress
) -> tuple[float, float]:
    """(interactive requests/s, batch output tokens/s) the engine finishes in a burst of each."""
    p, vocab, seed = args.p, loaded.model.config.vocab_size, args.seeds[0]
    count = p["burst_requests"]
    chat_burst = make_requests("cap-i", count, p["interactive"], Priority.INTERACTIVE, vocab,
                               seed + 1)  # fmt: skip
    rps, _ = burst(engine, chat_burst, new_clock(p))
    batch_burst = make_requests("cap-b", count, p["batch"], Priority.BATCH, vocab, seed + 2)
    _, batch_tps = burst(engine, batch_burst, new_clock(p))
    log(f"capacity: {rps:.2f} interactive req/s, {batch_tps:.0f} batch tok/s")
    return rps, batch_tps


def measure_seed(
    engine: PagedEngine,
    loaded: LoadedModel,
    args: argparse.Namespace,
    cap: tuple[float, float],
    seed: int,
    log: Progress,
) -> dict[str, Any]:
    """One seed's two runs, `alone` and `with_batch`, on the same arrivals."""
    p, vocab = args.p, loaded.model.config.vocab_size
    chat, batch_shape = p["interactive"], p["batch"]
    rps, batch_tps = cap
    rate = args.load * rps
    window, drain = p["window_s"], p["drain_s"]
    times = poisson_arrivals(rate, window, seed + 3)
    chats = make_requests(f"chat{seed}", len(times), chat, Priority.INTERACTIVE, vocab, seed + 4)
    queue = 2 * p["max_num_seqs"]
    alone = drive(
        engine, list(zip(times, chats, strict=True)), [], new_clock(p), window, drain, queue
    )
    log(f"seed {seed} alone: {summary(alone)}")
    # More than the engine can finish in the whole run, at its batch capacity.
    mean_answer = sum(batch_shape.answer) / 2
    batch_count = int(batch_tps * (window + drain) / mean_answer * 1.5) + p["max_num_seqs"]
    batch = make_requests(f"batch{seed}", batch_count, batch_shape, Priority.BATCH, vocab,
                          seed + 5)  # fmt: skip
    mixed = drive(
        engine, list(zip(times, chats, strict=True)), batch, new_clock(p), window, drain, queue
    )
    log(f"seed {seed} with batch ({batch_count} queued): {summary(mixed)}")
    idle_tokens = batch_tps * window * (1 - args.load)
    return {
        "seed": seed,
        "interactive_rate_rps": rate,
        "batch_requests_queued": batch_count,
        "idle_batch_tokens": idle_tokens,
        "runs": {"alone": summary(alone), "with_batch": summary(mixed)},
        "interactive_ttft_p99_ratio": ratio(mixed.p99(mixed.ttft_s), alone.p99(alone.ttft_s)),
        "interactive_tpot_p99_ratio": ratio(mixed.p99(mixed.tpot_s), alone.p99(alone.tpot_s)),
        "batch_share_of_idle": ratio(float(mixed.batch_tokens_in_window), idle_tokens),
    }


KEYS = ("interactive_ttft_p99_ratio", "interactive_tpot_p99_ratio", "batch_share_of_idle")


def aggregate(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each key's median over the seeds, and its minimum and maximum (None where a seed has
    none: a run that finished no interactive request)."""
    out: dict[str, Any] = {}
    for key in KEYS:
        values = [s[key] for s in seeds]
        known = sorted(v for v in values if v is not None)
        complete = len(known) == len(values)
        out[key] = statistics.median(known) if complete else None
        out[f"{key}_min"] = known[0] if complete else None
        out[f"{key}_max"] = known[-1] if complete else None
    return out


def report(result: dict[str, Any]) -> str:
    rows = [
        [
            seed["seed"],
            name,
            r["interactive_finished"],
            r["interactive_requests"],
            r["ttft_p50_ms"],
            r["ttft_p99_ms"],
            r["tpot_p99_ms"],
            r["batch_tokens_in_window"],
            r["preemptions"].get("batch", 0),
            r["interactive_cached_prompt_tokens"],
        ]
        for seed in result["seeds"]
        for name, r in seed["runs"].items()
    ]
    headers = ["seed", "run", "interactive done", "of", "TTFT p50 ms", "TTFT p99 ms",
               "TPOT p99 ms", "batch tokens", "batch preemptions",
               "interactive prompt tokens cached"]  # fmt: skip
    per_seed = markdown_table(
        ["seed", *KEYS], [[seed["seed"], *(seed[k] for k in KEYS)] for seed in result["seeds"]]
    )
    keys = markdown_table(
        ["key", "median", "min", "max", "goal"],
        [
            [key, result[key], result[f"{key}_min"], result[f"{key}_max"], goal]
            for key, goal in zip(KEYS, ("<= 1.2", "<= 1.2", ">= 0.8"), strict=True)
        ],
    )
    return (
        f"{keys}\n\nBy seed:\n\n{per_seed}\n\n{markdown_table(headers, rows)}\n\n"
        f"Capacity: {result['capacity']}; deferral bound {result['deferral_bound_tokens']} "
        f"tokens, slack {result['deferral_bound_slack']}; {result['clock']}; "
        f"{result['window_s']} s of arrivals a run.\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    log = Progress()
    p = args.p
    loaded = preset_model(p, args.model_dir, args.tokenizer_dir, log, f"priority-{args.preset}")
    engine = build_engine(loaded, p)
    warm_up(engine, loaded.model.config.vocab_size, min(4, p["max_num_seqs"]), 0)
    device = device_label(loaded)
    rps, batch_tps = capacity(engine, loaded, args, log)
    result: dict[str, Any] = {
        "preset": args.preset,
        "device": device,
        "load": args.load,
        "deferral_bound_tokens": p["deferral_bound_tokens"],
        "deferral_bound_slack": p["deferral_bound_slack"],
        "window_s": p["window_s"],
        "drain_s": p["drain_s"],
        "clock": "token clock " + str(p["clock"]) if p["clock"] else "wall clock",
        "engine": {k: p[k] for k in ("max_num_seqs", "max_num_batched_tokens")},
        "engine_batch_queue": 2 * p["max_num_seqs"],
        "kv_blocks": engine.limits.kv_blocks_total,
        "shape": p["shape"],
        "capacity": {"interactive_rps": rps, "batch_output_tokens_per_s": batch_tps},
        "seeds": [],
    }
    name = args.name or f"priority_{device}"
    command = command_line("bench.engine.priority", argv)
    for seed in args.seeds:
        result["seeds"].append(measure_seed(engine, loaded, args, (rps, batch_tps), seed, log))
        result |= aggregate(result["seeds"])
        result["complete"] = len(result["seeds"]) == len(args.seeds)
        # Written after every seed, so that a run cut short keeps what it measured.
        path = write_results(name, result, report(result), command, args.results_dir)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
