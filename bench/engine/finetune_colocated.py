"""A LoRA fine-tuning job trained beside an engine serving interactive chat (issues 54, 70): how
much of its alone speed the job keeps, and what it costs interactive latency.

Issue 70's mode (`--mode rows`, the default): the job's training rows ride with every serving
step (site_engine/finetune/step_work.py): each step's piece gets only the room the serving
batch leaves in the step's token budget, none while a request waits, and is sized to stay
within `--max-training-delay-ms`; `--mode idle` is issue 54's units between steps. One engine
serves every load (`--loads`, one results file each, *_load<L>.{json,md}) and seed (`--seeds`):
each key is its worst seed's against its goal, with the seeds' min-max beside it, and
`max_training_delay_ms` is the longest training piece run while a request was in the engine.

    python -m bench.engine.finetune_colocated               (GPU: bench/results/
                                                             finetune_colocated/*_<gpu>.*)
    python -m bench.engine.finetune_colocated --preset cpu  (CPU smoke: *_cpu.*)

One engine, warmed up, with SITE_FINETUNE_RESERVE_BYTES taken out of its KV cache as a site
takes it, and the site's own trainer (site_engine/finetune/jobs.py) gated by the site's own
IdleGate between model steps, as EngineService runs it:
1. Capacity: a burst of interactive-shaped requests (all at once) gives the requests/s the
   engine finishes.
2. `job_alone`: the job's units back to back with no requests for `job_alone_s`: its tokens/s
   (idle-sized units, `run_unit(alone=True)`, as a site runs them with no request in).
3. `alone`: interactive chat arriving as a Poisson process at each load x capacity for
   `window_s`, then drained; no job.
4. `with_job`: the same arrivals with the job running in the idle cycles.
0. `peft_alone` (before the engine is built, so it has the memory): a plain peft +
   transformers loop on the same model at `peft_step` (8x512 tokens a step on the GPU; bf16,
   SDPA, fused AdamW; bench/engine/finetune_profile.py's), for `trainer_vs_peft` (goal >= 0.8):
   against `job_at_peft_step`, the site's trainer alone with nothing waiting (idle-sized units,
   `run_unit(alone=True)`, in bounded pieces as a site runs them) on a job of the loop's shape:
   examples of exactly the loop's width (longer chats cut to it), batches of its rows, the
   idle unit size one whole batch (SITE_FINETUNE_IDLE_UNIT_TOKENS' 4096 = 8x512 on the GPU).
Keys: `job_tokens_per_s_vs_alone` (the job's trained tokens/s within the with_job window over
its job_alone tokens/s; goal >= 0.5) and `interactive_ttft_p99_ratio` (with_job / alone; goal
<= 1.2), with `interactive_tpot_p99_ratio` beside them.

The job's data is a synthetic chat JSONL made here (random words, chat-like lengths) with more
epochs than the bench can finish, so the job runs through every phase; it is cancelled at the
end. Both presets run on the wall clock; the CPU preset is a smoke test of the wiring (a tiny
model on a shared CPU), its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, markdown_table, write_results
from bench.engine.engine_runs import warm_up
from bench.engine.finetune_driver import JobClock, drive_with_job, run_job_alone
from bench.engine.finetune_job import (
    freeze_startup,
    job_at_peft_step,
    peft_alone,
    start_job,
    training_memory,
)
from bench.engine.gc_pauses import GcPauses
from bench.engine.harness import GIB, Progress
from bench.engine.model_setup import LLAMA_8B_8K_SHAPE, preset_model
from bench.engine.presets import WallClock, device_label, preset_parser, tiny_shape
from bench.engine.priority import build_engine, ratio, summary
from bench.engine.priority_driver import Shape, burst, make_requests, poisson_arrivals
from fedllm_contract.priority import Priority
from site_engine.finetune.jobs import FineTuneJobs
from site_engine.finetune.pieces import MeasuredPiece
from site_engine.finetune.step_rows import StepRows
from site_engine.finetune.step_work import PIECE_SHARE, NextStep, StepRowsWork, rows_gate
from site_engine.idle_work import DEFAULT_BUSY_SHARE, IdleGate
from site_engine.model_loading import LoadedModel

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        "shape": LLAMA_8B_8K_SHAPE,
        "device": "cuda",
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "kv_cache_gib": 0.0,  # what the GPU has after the weights, a trial step and the reserve
        "deferral_bound_tokens": 512,
        "clock": None,  # the wall clock (bench.engine.priority.build_engine reads it)
        # 12 GiB ran out of memory on the H100: site_engine/finetune/memory.py's estimate is low.
        "reserve_gib": 30.0,
        "max_step_ms": 200.0,  # SITE_FINETUNE_MAX_STEP_MS's default
        # Rows mode: the most a step's training piece may take (issue 70's goal: <= 10 ms).
        "max_training_delay_ms": 8.0,
        "interactive": Shape(prompt=(64, 768), answer=(32, 256)),
        "burst_requests": 256,
        "window_s": 30.0,
        "drain_s": 10.0,
        "job_alone_s": 20.0,
        # The job: examples of about `example_words` words, batches of `batch_size`.
        "examples": 512,
        "example_words": (64, 320),
        "batch_size": 8,
        "max_tokens": 512,
        # The standalone peft + transformers loop's step (rows x tokens): trainer_vs_peft.
        "peft_step": (8, 512),
    },
    "cpu": {
        "shape": tiny_shape(1024),
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "kv_cache_blocks": 192,
        "deferral_bound_tokens": 32,
        "clock": None,
        "reserve_gib": 0.25,
        "max_step_ms": 50.0,
        "max_training_delay_ms": 50.0,
        "interactive": Shape(prompt=(16, 96), answer=(8, 32)),
        "burst_requests": 32,
        "window_s": 6.0,
        "drain_s": 6.0,
        "job_alone_s": 3.0,
        "examples": 64,
        "example_words": (8, 40),
        "batch_size": 4,
        "max_tokens": 128,
        "peft_step": (2, 64),
    },
}
# Issue 70's "Must show" (job_tokens_per_s_vs_alone's goal is 0.4 at 0.6x load, 0.6 at 0.3x).
KEYS = (
    "trainer_vs_peft",
    "job_alone_vs_peft",
    "job_tokens_per_s_vs_alone",
    "interactive_ttft_p99_ratio",
    "interactive_tpot_p99_ratio",
    "max_training_delay_ms",
)
GOALS = (">= 0.85", ">= 0.8", ">= 0.4 (0.6x) / 0.6 (0.3x)", "<= 1.3", "<= 1.2", "<= 10")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    runs = ("window_s", "drain_s", "burst_requests")
    parser, add = preset_parser(
        "bench.engine.finetune_colocated", __doc__, PRESETS, "finetune_colocated", *runs
    )
    add("--loads", default="0.6,0.3", help="interactive rate / capacity: one file per load")
    add("--seeds", default="0,1,2", help="seeds, each a run at every load (min-max reported)")
    add(
        "--mode",
        choices=("rows", "idle"),
        default="rows",
        help="rows: training rows beside each step (issue 70); idle: units between steps",
    )
    add("--max-training-delay-ms", type=float, default=None, help="rows mode's bound")
    add("--piece-share", type=float, default=PIECE_SHARE,
        help="rows mode: a piece's bound as a share of --max-training-delay-ms (the site's "
        "PIECE_SHARE by default)")  # fmt: skip
    add("--wait-for-pieces", action="store_true",
        help="the arm without queued pieces: the device settled before each training piece "
        "and each piece waited for as it ends (FineTuneJobs' wait_for_pieces)")  # fmt: skip
    add("--job-alone-s", type=float, default=None, help="seconds of the job with no load")
    add("--max-step-ms", type=float, default=None, help="SITE_FINETUNE_MAX_STEP_MS")
    add("--busy-share", type=float, default=DEFAULT_BUSY_SHARE,
        help="IdleGate.busy_share: the most of the time units take while requests run")  # fmt: skip
    add("--reserve-gib", type=float, default=None, help="SITE_FINETUNE_RESERVE_BYTES, in GiB")
    args = parser.parse_args(argv)
    try:
        args.loads = [float(x) for x in args.loads.split(",")]
        args.seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        parser.error("--loads and --seeds are comma-separated numbers")
    if not all(0 < load < 1 for load in args.loads) or not args.seeds:
        parser.error("--loads must be in (0, 1), and one seed at least")
    if not 0 < args.busy_share <= 1:
        parser.error("--busy-share must be in (0, 1]")
    if not 0 < args.piece_share <= 1:
        parser.error("--piece-share must be in (0, 1]")
    args.p = dict(PRESETS[args.preset]) | {
        "piece_share": args.piece_share,
        "wait_for_pieces": args.wait_for_pieces,
    }
    for key in (*runs, "job_alone_s", "max_step_ms", "reserve_gib", "max_training_delay_ms"):
        if getattr(args, key) is not None:
            if not getattr(args, key) > 0:
                parser.error(f"--{key.replace('_', '-')} must be > 0")
            args.p[key] = getattr(args, key)
    return args


def measure(
    loaded: LoadedModel,
    args: argparse.Namespace,
    job_dir: Path,
    log: Progress,
    write: Callable[[float, dict[str, Any], dict[int, dict[str, Any]]], None],
) -> None:
    """What every seed and load shares (the peft loop, the engine, its capacity, the trainer
    alone at the peft step), then each load's seeds, written (`write`) as soon as they are
    measured: a device call cut short keeps the loads it finished."""
    p, vocab = args.p, loaded.model.config.vocab_size
    # Before the engine takes the memory its cache may: the loop's 8x512 step needs its own.
    peft = peft_alone(loaded.model, *p["peft_step"])
    log(f"peft + transformers alone: {peft}")
    engine = build_engine(loaded, p | {"finetune_reserve_bytes": int(p["reserve_gib"] * GIB)})
    warm_up(engine, vocab, min(4, p["max_num_seqs"]), 0)
    freeze_startup()
    cap_requests = make_requests("cap", p["burst_requests"], p["interactive"],
                                 Priority.INTERACTIVE, vocab, args.seeds[0] + 1)  # fmt: skip
    rps, _ = burst(engine, cap_requests, WallClock())
    log(f"capacity: {rps:.2f} interactive req/s")
    at_peft = job_at_peft_step(loaded, p, job_dir / "peft-shaped", args.seeds[0])
    log(f"site trainer alone at the peft step: {at_peft}")
    # Issue 76's job_alone_vs_peft: the same, in the pieces the mode runs (rows: piece_share of
    # the step's delay bound, against the idle mode's max_step_ms above).
    in_mode = at_peft
    if args.mode == "rows":
        piece_ms = p["max_training_delay_ms"] * p["piece_share"]
        in_mode = job_at_peft_step(loaded, p | {"max_step_ms": piece_ms},
                                   job_dir / "peft-shaped-rows", args.seeds[0])  # fmt: skip
        log(f"the same in rows mode's {piece_ms:g} ms pieces: {in_mode}")
    shared = {
        "capacity": {"interactive_rps": rps},
        "kv_blocks": engine.limits.kv_blocks_total,
        "peft_alone": peft,
        "job_at_peft_step": at_peft,
        "trainer_vs_peft": ratio(at_peft["tokens_per_s"], peft["tokens_per_s"]),
        "job_at_peft_step_in_mode": in_mode,
        "job_alone_vs_peft": ratio(in_mode["tokens_per_s"], peft["tokens_per_s"]),
    }
    for load in args.loads:
        seeds = {seed: measure_seed(loaded, engine, args, load * rps, seed, job_dir, log)
                 for seed in args.seeds}  # fmt: skip
        write(load, shared, seeds)


@dataclass(slots=True)
class LongPieces:
    """Each piece over the bound as the ledger measured it (PieceLedger.observer), by phase."""

    bound_s: float
    phase: str = "job alone"
    found: list[dict[str, Any]] = field(default_factory=list)

    def observe(self, piece: MeasuredPiece) -> None:
        if piece.seconds <= self.bound_s:
            return
        self.found.append({
            "phase": self.phase, "ms": 1000 * piece.seconds, "tokens": piece.tokens,
            "segments": [(kind, round(1000 * device, 3), round(1000 * host, 3))
                         for kind, device, host in piece.segments],
        })  # fmt: skip


def over_bound(
    job: JobClock, calls_before: int, bound_ms: float, pauses: GcPauses
) -> list[dict[str, Any]]:
    """Each piece beside requests over the bound, with the collector's pauses in the call that
    queued it: with a deferred ledger (CUDA) a call measures the piece the call before it
    queued, and its own only when it ended a unit; else its own."""
    deferred = job.jobs.ledger.deferred
    found = []
    for n, (call, seconds) in enumerate(job.pieces):
        # a second piece measured by one call is the call's own (it ended the unit)
        own = not deferred or (n > 0 and job.pieces[n - 1][0] == call)
        if call < max(calls_before, 1) or not job.windows[call][2] or 1000 * seconds <= bound_ms:
            continue
        queued_in = job.windows[call] if own else job.windows[call - 1]
        found.append({"ms": 1000 * seconds, "gc_ms_while_queued": pauses.within(*queued_in[:2])})
    return found


def job_work(
    jobs: FineTuneJobs, engine: Any, args: argparse.Namespace
) -> tuple[JobClock, IdleGate]:
    """The job as the site runs it in `args.mode`: rows beside each step, or idle units."""
    p = args.p
    if args.mode == "rows":
        rows = StepRows(p["max_training_delay_ms"])
        next_step = NextStep(engine.token_budget, p["max_num_seqs"], engine.limits.kv_block_size)
        work = StepRowsWork(jobs, rows, next_step, engine.stats)
        return JobClock(jobs, "bench-job", work), rows_gate(p["max_training_delay_ms"], next_step)
    gate = IdleGate(p["max_step_ms"] / 1000, busy_share=args.busy_share)
    return JobClock(jobs, "bench-job"), gate


def measure_seed(
    loaded: LoadedModel,
    engine: Any,
    args: argparse.Namespace,
    rate_rps: float,
    seed: int,
    job_dir: Path,
    log: Progress,
) -> dict[str, Any]:
    """One seed at one load: the job alone, chat alone, chat with the job."""
    p, vocab, chat = args.p, loaded.model.config.vocab_size, args.p["interactive"]
    jobs = start_job(loaded, p, job_dir / f"{rate_rps:.3f}-{seed}", seed, args.mode)
    long_pieces = LongPieces(p["max_training_delay_ms"] / 1000)
    jobs.ledger.observer = long_pieces.observe
    job, gate = job_work(jobs, engine, args)
    cuda = loaded.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated() if cuda else 0
    for _ in range(3):  # the trainer's first units build it: kept out of the measures
        job.run_unit(alone=True)
    alone_job = run_job_alone(job, p["job_alone_s"])
    log(f"seed {seed}: job alone: {alone_job}")
    memory = training_memory(
        jobs, loaded, torch.cuda.max_memory_allocated() - allocated if cuda else None
    )
    times = poisson_arrivals(rate_rps, p["window_s"], seed + 3)
    runs, gc_pauses, over = {}, {}, []
    before = len(job.beside_s)
    for name in ("alone", "with_job"):
        chats = make_requests(f"chat-{name}", len(times), chat, Priority.INTERACTIVE, vocab,
                              seed + 4)  # fmt: skip
        arrivals = list(zip(times, chats, strict=True))
        calls_before = len(job.windows)
        long_pieces.phase = name
        with GcPauses() as pauses:
            runs[name] = drive_with_job(engine, arrivals,
                                        (job, gate) if name == "with_job" else None,
                                        p["window_s"], p["drain_s"])  # fmt: skip
        gc_pauses[name] = pauses.summary()
        if name == "with_job":
            over = over_bound(job, calls_before, p["max_training_delay_ms"], pauses)
    (alone, _), (mixed, with_job) = runs["alone"], runs["with_job"]
    log(f"seed {seed} at {rate_rps:.2f} req/s: alone {summary(alone)}; with job "
        f"{summary(mixed)}; job {with_job}")  # fmt: skip
    beside = job.beside_s[before:]  # every piece run while a request was in
    jobs.cancel("bench-job")
    jobs.run_unit()  # drops the cancelled job's trainer
    rows = getattr(job.work, "rows", None)
    job_rate = with_job["trained_tokens_per_s"] if with_job else None
    return {
        "interactive_rate_rps": rate_rps,
        "job": {"alone": alone_job, "with_load": with_job},
        "training_memory": memory,
        "runs": {"alone": summary(alone), "with_job": summary(mixed)},
        "rows": None if rows is None else {
            "steps_with_rows": rows.steps_with_rows, "rows_run": rows.rows_run,
            "over_bound": rows.over_bound, "skipped_waiting": rows.skipped_waiting},
        "job_tokens_per_s_vs_alone": ratio(job_rate, alone_job["trained_tokens_per_s"]),
        "interactive_ttft_p99_ratio": ratio(mixed.p99(mixed.ttft_s), alone.p99(alone.ttft_s)),
        "interactive_tpot_p99_ratio": ratio(mixed.p99(mixed.tpot_s), alone.p99(alone.tpot_s)),
        "max_training_delay_ms": 1000 * max(beside, default=0.0),
        # The host's pauses (pieces are timed on the device, where a pause does not show).
        "gc_pauses": gc_pauses,
        "pieces_over_bound": over,
        # Every piece over the bound, any phase: its segments' device and host milliseconds.
        "long_pieces": long_pieces.found,
    }  # fmt: skip


def worst(key: str, values: list[Any]) -> Any:
    """The seeds' worst value of a key against its goal (None where a seed has none)."""
    if any(v is None for v in values) or not values:
        return None
    return min(values) if GOALS[KEYS.index(key)].startswith(">=") else max(values)


def load_result(
    shared: dict[str, Any], seeds: dict[int, dict[str, Any]], load: float
) -> dict[str, Any]:
    """One load's file: each key the worst seed's (against its goal) with the seeds' min-max,
    trainer_vs_peft the shared one, and every seed's figures."""
    out: dict[str, Any] = {"load": load, "seeds": sorted(seeds), **shared}
    for key in KEYS:
        shared_key = key in ("trainer_vs_peft", "job_alone_vs_peft")
        values = [shared[key]] if shared_key else [s[key] for s in seeds.values()]
        out[key] = worst(key, values)
        present = [v for v in values if v is not None]
        out[f"{key}_min_max"] = [min(present), max(present)] if present else None
    return out | {"by_seed": seeds}


def report(result: dict[str, Any]) -> str:
    keys = markdown_table(
        ["key", "worst seed", "min-max", "goal"],
        [[key, result[key], result[f"{key}_min_max"], goal]
         for key, goal in zip(KEYS, GOALS, strict=True)],
    )  # fmt: skip
    runs = markdown_table(
        ["seed", "run", "interactive done", "of", "TTFT p99 ms", "TPOT p99 ms", "steps"],
        [
            [seed, name, r["interactive_finished"], r["interactive_requests"], r["ttft_p99_ms"],
             r["tpot_p99_ms"], r["steps"]]
            for seed, one in result["by_seed"].items()
            for name, r in one["runs"].items()
        ],
    )  # fmt: skip
    jobs = "\n".join(
        f"- seed {seed}: alone {one['job']['alone']}; under load {one['job']['with_load']}; "
        f"rows {one['rows']}; training memory {one['training_memory']}; "
        f"garbage collector's pauses {one.get('gc_pauses')}; "
        f"pieces over the bound {one.get('pieces_over_bound')}"
        for seed, one in result["by_seed"].items()
    )
    return (
        f"Mode: {result['mode']}; load {result['load']}.\n\n{keys}\n\n{runs}\n\n{jobs}\n\n"
        f"Trainer alone at the peft step: {result['job_at_peft_step']}; peft + transformers: "
        f"{result['peft_alone']}\n\n"
        f"Capacity: {result['capacity']} for {result['window_s']} s a run; "
        f"reserve {result['reserve_gib']} GiB, max unit {result['max_step_ms']} ms, "
        f"max training delay {result['max_training_delay_ms_bound']} ms, pieces sized to "
        f"{result.get('piece_share')} of it; "
        f"{result['kv_blocks']} KV blocks.\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    log = Progress()
    p = args.p
    loaded = preset_model(p, args.model_dir, args.tokenizer_dir, log, f"finetune-{args.preset}")
    device = device_label(loaded)
    settings: dict[str, Any] = {
        "preset": args.preset,
        "device": device,
        "mode": args.mode,
        "window_s": p["window_s"],
        "drain_s": p["drain_s"],
        "job_alone_s": p["job_alone_s"],
        "reserve_gib": p["reserve_gib"],
        "max_step_ms": p["max_step_ms"],
        "max_training_delay_ms_bound": p["max_training_delay_ms"],
        "piece_share": p["piece_share"],
        "busy_share": args.busy_share,
        "deferral_bound_tokens": p["deferral_bound_tokens"],
        "engine": {k: p[k] for k in ("max_num_seqs", "max_num_batched_tokens")},
        "training": {k: p[k] for k in ("examples", "example_words", "batch_size", "max_tokens")},
        "shape": p["shape"],
        "clock": "wall clock",
    }
    command = command_line("bench.engine.finetune_colocated", argv)

    def write(load: float, shared: dict[str, Any], seeds: dict[int, dict[str, Any]]) -> None:
        result = settings | load_result(shared, seeds, load) | {"measured_at_unix_s": time.time()}
        name = f"{args.name or f'finetune_colocated_{device}'}_load{load:g}"
        path = write_results(name, result, report(result), command, args.results_dir)
        log(f"wrote {path}")

    with tempfile.TemporaryDirectory(prefix="fedllm-finetune-bench-") as job_dir:
        try:
            measure(loaded, args, Path(job_dir), log, write)
        finally:
            gc.unfreeze()  # measure froze what start-up built; a caller's process goes on


if __name__ == "__main__":
    main()
