"""The timeline of a fine-tuning job beside serving (issue 76): every training piece the engine's
thread runs, its shape, where it ended, its host and device time, the allocator and the garbage
collector inside it, and the serving step it delayed; the cause of each piece over the bound
named (bench/engine/finetune_timeline_record.py), and a profiled stretch for the kernels of the
longest pieces.

    python -m bench.engine.finetune_timeline                (GPU, 8B shape: bench/results/
                                                             finetune_colocated/*_<gpu>.*)
    python -m bench.engine.finetune_timeline --preset cpu   (CPU smoke)

The engine, the job and the rows mode are bench.engine.finetune_colocated's (its PRESETS), from
the trainer's build on: a job's first calls are on the timeline, not warmed away. Phases:
`alone` (the job with no request, idle-sized units in bounded pieces, for --alone-s), `chat`
(Poisson chat at --load x capacity for --chat-s, the job's rows beside each step), `profiled`
(the same for --profile-s under torch.profiler: each call and step marked, and the kernels and
CUDA runtime calls inside the longest calls listed). The peft + transformers loop at the peft
step runs first, for `job_alone_vs_peft`.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import DeviceType

from bench.common import command_line, markdown_table, write_results
from bench.engine.engine_runs import warm_up
from bench.engine.finetune_colocated import PRESETS
from bench.engine.finetune_driver import JobClock, drive_with_job, run_job_alone
from bench.engine.finetune_job import freeze_startup, peft_alone, start_job
from bench.engine.finetune_timeline_record import TimedEngine, TimedWork, Timeline, summary
from bench.engine.harness import GIB, Progress
from bench.engine.model_setup import preset_model
from bench.engine.presets import WallClock, device_label, preset_parser
from bench.engine.priority import build_engine
from bench.engine.priority_driver import burst, make_requests, poisson_arrivals
from fedllm_contract.priority import Priority
from site_engine.finetune.step_rows import StepRows
from site_engine.finetune.step_work import PIECE_SHARE, NextStep, StepRowsWork, rows_gate


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser, add = preset_parser(
        "bench.engine.finetune_timeline", __doc__, PRESETS, "finetune_colocated"
    )
    add("--alone-s", type=float, default=12.0, help="seconds of the job with no request")
    add("--chat-s", type=float, default=20.0, help="seconds of chat arrivals beside the job")
    add("--profile-s", type=float, default=3.0, help="seconds of them profiled (0: none)")
    add("--load", type=float, default=0.6, help="chat rate / capacity")
    add("--seed", type=int, default=11)
    add("--wide-piece-ms", type=float, default=200.0, help="the alone phase again, wider pieces")
    add("--max-training-delay-ms", type=float, default=None, help="rows mode's bound")
    add("--piece-share", type=float, default=PIECE_SHARE, help="a piece's share of the bound")
    args = parser.parse_args(argv)
    if not 0 < args.load < 1 or args.alone_s <= 0 or args.chat_s <= 0 or args.profile_s < 0:
        parser.error("--load in (0, 1); --alone-s and --chat-s > 0; --profile-s >= 0")
    if not 0 < args.piece_share <= 1:
        parser.error("--piece-share must be in (0, 1]")
    args.p = dict(PRESETS[args.preset]) | {"piece_share": args.piece_share}
    if args.max_training_delay_ms is not None:
        args.p["max_training_delay_ms"] = args.max_training_delay_ms
    return args


def chat(rate: float, seconds: float, seed: int, p: dict[str, Any], vocab: int) -> list[Any]:
    times = poisson_arrivals(rate, seconds, seed)
    requests = make_requests(f"chat-{seed}", len(times), p["interactive"],
                             Priority.INTERACTIVE, vocab, seed)  # fmt: skip
    return list(zip(times, requests, strict=True))


def profiled_calls(prof: Any, bound_ms: float, most: int = 12) -> list[dict[str, Any]]:
    """The `most` longest marked job calls over the bound: the kernels and CUDA runtime calls
    inside each (by their time range, kernels by device time) and the longest host ops."""
    events = list(prof.events())
    marks = [e for e in events if e.name == "ft_call"]
    long = sorted((m for m in marks if m.time_range.elapsed_us() > 1000 * bound_ms),
                  key=lambda m: -m.time_range.elapsed_us())[:most]  # fmt: skip
    out = []
    for mark in long:
        lo, hi = mark.time_range.start, mark.time_range.end
        inside = [e for e in events if lo <= e.time_range.start < hi and e is not mark]
        kernels: dict[str, float] = {}
        for e in inside:
            if e.device_type == DeviceType.CUDA:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us()
        runtime = [e for e in inside if e.device_type == DeviceType.CPU
                   and e.name.startswith("cuda") and e.name != "cudaLaunchKernel"]  # fmt: skip
        host = [e for e in inside if e.device_type == DeviceType.CPU]
        out.append({
            "call_ms": mark.time_range.elapsed_us() / 1000,
            "kernel_ms": sum(kernels.values()) / 1000,
            "kernels": len([e for e in inside if e.device_type == DeviceType.CUDA]),
            "top_kernels_ms": {k[:90]: v / 1000 for k, v in
                               sorted(kernels.items(), key=lambda kv: -kv[1])[:6]},
            "runtime_calls_ms": [(e.name, e.time_range.elapsed_us() / 1000) for e in
                                 sorted(runtime, key=lambda e: -e.time_range.elapsed_us())[:6]],
            "longest_host_ops_ms": [(e.name[:60], e.time_range.elapsed_us() / 1000) for e in
                                    sorted(host, key=lambda e: -e.time_range.elapsed_us())[:8]],
        })  # fmt: skip
    return out


def run_profiled(engine: Any, arrivals: list[Any], job: tuple[JobClock, Any], seconds: float,
                 timeline: Timeline, bound_ms: float) -> list[dict[str, Any]]:  # fmt: skip
    activities = [torch.profiler.ProfilerActivity.CPU]
    if timeline.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    timeline.mark = True
    with torch.profiler.profile(activities=activities) as prof:
        drive_with_job(engine, arrivals, job, seconds, 5.0)
    timeline.mark = False
    return profiled_calls(prof, bound_ms)


def _q(stats: dict[str, float] | None, q: str) -> float | None:
    return None if stats is None else round(stats[q], 2)


def _call_line(c: dict[str, Any]) -> str:
    piece = c["piece"] or {}
    device = c["device_ms"] and round(c["device_ms"], 1)
    return (
        f"{c['took_ms']:.1f} ms at {c['t_s']:.1f} s ({device} device span; "
        f"{piece.get('unit_shape')} ended at {piece.get('ended_at')}): {', '.join(c['causes'])}"
    )


def report(result: dict[str, Any]) -> str:
    phases = result["timeline"]
    rows = [
        [name, s["calls"], _q(s["call_ms"], "p50"), _q(s["call_ms"], "p99"),
         _q(s["call_ms"], "max"), s["over_bound"], s["device_span_share"], s["allocator"],
         round(s["gc_ms"], 1), s["new_shapes"], _q(s["serving_step_ms"], "p50")]
        for name, s in phases.items()
    ]  # fmt: skip
    table = markdown_table(
        ["phase", "calls", "p50 ms", "p99 ms", "max ms", "over bound", "device span share",
         "allocator", "gc ms", "new shapes", "serving step p50 ms"], rows)  # fmt: skip
    longest = "\n".join(
        f"- {name}: " + "; ".join(_call_line(c) for c in s["longest"][:8])
        for name, s in phases.items()
    )
    causes = "\n".join(f"- {name}: {s['causes']}" for name, s in phases.items())
    profiled = "\n".join(f"- {c}" for c in result["profiled_longest"])
    return (
        f"Bound {result['bound_ms']} ms (rows mode's max_training_delay_ms); pieces sized to "
        f"{result.get('piece_bound_ms')} ms.\n\n{table}\n\nCauses of the calls over the bound:\n"
        f"{causes}\n\nLongest calls:\n{longest}\n\nProfiled ({result['profile_s']} s):\n"
        f"{profiled or '- none over the bound'}\n\nJob alone: {result.get('job_alone')}; peft "
        f"alone: {result['peft_alone']}; job_alone_vs_peft {result.get('job_alone_vs_peft')}; "
        f"in wide pieces: {result.get('job_alone_wide_pieces')}.\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    log, p = Progress(), args.p
    loaded = preset_model(p, args.model_dir, args.tokenizer_dir, log, f"finetune-{args.preset}")
    vocab, bound = loaded.model.config.vocab_size, p["max_training_delay_ms"]
    peft = peft_alone(loaded.model, *p["peft_step"])
    log(f"peft alone: {peft}")
    engine = build_engine(loaded, p | {"finetune_reserve_bytes": int(p["reserve_gib"] * GIB)})
    warm_up(engine, vocab, min(4, p["max_num_seqs"]), 0)
    freeze_startup()
    cap = make_requests("cap", p["burst_requests"], p["interactive"], Priority.INTERACTIVE,
                        vocab, args.seed + 1)  # fmt: skip
    rps, _ = burst(engine, cap, WallClock())
    log(f"capacity {rps:.2f} req/s")
    timeline = Timeline(loaded.device.type == "cuda", loaded.model.config.num_hidden_layers)
    timed = TimedEngine(engine, timeline)
    result: dict[str, Any] = {
        "preset": args.preset, "device": device_label(loaded), "load": args.load,
        "capacity_rps": rps, "bound_ms": bound, "profile_s": args.profile_s, "peft_alone": peft,
        "profiled_longest": [],
    }  # fmt: skip
    name = args.name or f"finetune_timeline_{device_label(loaded)}"
    command = command_line("bench.engine.finetune_timeline", argv)

    def write(phase: str) -> None:
        """After each phase: a call cut short keeps what it measured."""
        result["timeline"] = summary(timeline, bound)
        path = write_results(name, result, report(result), command, args.results_dir)
        log(f"{phase} done: wrote {path}")

    with tempfile.TemporaryDirectory(prefix="fedllm-ft-timeline-") as job_dir:
        # The job alone in pieces of the idle mode's bound first (what small pieces cost), its
        # trainer gone before the bounded job's starts: a unit paused inside its backward holds
        # the device's autograd thread, so two units must never be under way at once.
        timeline.phase = f"alone, {args.wide_piece_ms:g} ms pieces"
        wide_jobs = start_job(loaded, p | {"max_step_ms": args.wide_piece_ms},
                              Path(job_dir) / "wide", args.seed, "idle")  # fmt: skip
        wide_jobs.on_piece = timeline.on_piece
        wide_clock = JobClock(wide_jobs, "bench-job", TimedWork(wide_jobs, timeline))
        result["job_alone_wide_pieces"] = run_job_alone(wide_clock, args.alone_s / 2)
        wide_jobs.cancel("bench-job")
        wide_jobs.run_unit()
        write(timeline.phase)
        jobs = start_job(loaded, p, Path(job_dir) / "bounded", args.seed, "rows")
        jobs.on_piece = timeline.on_piece
        result["piece_bound_ms"] = jobs.settings.max_step_ms
        next_step = NextStep(engine.token_budget, p["max_num_seqs"], engine.limits.kv_block_size)
        work = StepRowsWork(jobs, StepRows(bound), next_step, engine.stats)
        clock = JobClock(jobs, "bench-job", TimedWork(work, timeline))
        job = (clock, rows_gate(bound, next_step))
        timeline.phase = "alone"
        result["job_alone"] = alone = run_job_alone(clock, args.alone_s)
        result["job_alone_vs_peft"] = (alone["trained_tokens_per_s"] or 0) / peft["tokens_per_s"]
        write(timeline.phase)
        timeline.phase = "chat"
        arrivals = chat(args.load * rps, args.chat_s, args.seed + 3, p, vocab)
        drive_with_job(timed, arrivals, job, args.chat_s, 5.0)  # type: ignore[arg-type]
        write(timeline.phase)
        if args.profile_s:
            timeline.phase = "profiled"
            arrivals = chat(args.load * rps, args.profile_s, args.seed + 5, p, vocab)
            result["profiled_longest"] = run_profiled(timed, arrivals, job, args.profile_s,
                                                      timeline, bound)  # fmt: skip
            write(timeline.phase)
        jobs.cancel("bench-job")
        jobs.run_unit()
    timeline.close()


if __name__ == "__main__":
    main()
