"""What a busy event loop costs the engine thread's host work in one site process, by the
interpreter's switch interval, on the CPU (issue 78).

The engine thread's host work is the real scheduler's (site_engine.engine.core.scheduling:
schedule, update with one token a row, the stats the service publishes) over `rows` decode
rows, no model; beside it, a thread that never waits, as the site's event loop when it serves
more streams than it can keep up with. Each NumPy call over more than 500 elements lets the
GIL go, and the engine thread gets it back only when the busy thread is made to drop it, one
switch interval later (SITE_SWITCH_INTERVAL_US). Each point is its own process (the interval
is process-wide), `--seconds` of steps, `--reps` times: the step's p50 and the busy thread's
work done (a unit: ~5 us of Python), min-max over the reps.

    python -m bench.serving_path.gil_handoff [--rows 400 1000] [--intervals-us 5000 500 100 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import markdown_table, results_dir, write_results
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams

PROMPT = 64
ANSWER = 4000
# Steps a scheduler runs before it is built anew (untimed), so every timed step holds every row.
STEPS_PER_BUILD = ANSWER - 100


def scheduler_at(rows: int) -> Scheduler:
    """A scheduler with `rows` sequences decoding (their prompts computed)."""
    blocks = rows * (PROMPT + 4096) // 16 + 16
    config = SchedulerConfig(
        num_blocks=blocks,
        block_size=16,
        max_num_seqs=rows,
        max_num_batched_tokens=max(rows * PROMPT, 8192),
        max_model_len=PROMPT + 4096,
        eos_token_ids=frozenset({0}),
        prefix_caching=True,
    )
    scheduler = Scheduler(config)
    for i in range(rows):
        prompt = [1 + (i * 7 + j) % 30000 for j in range(PROMPT)]
        scheduler.add(f"r{i}", prompt, SamplingParams(max_tokens=ANSWER, temperature=0.0))
    while scheduler.stats().num_waiting:
        step(scheduler)
    return scheduler


def step(scheduler: Scheduler) -> None:
    """One step's host work: plan, apply a token to every sampled row, the published stats."""
    output = scheduler.schedule()
    tokens = np.ones(output.num_sampled, dtype=np.int64)
    scheduler.update(output, ModelRunnerOutput(tokens=tokens))
    scheduler.stats()


def point(rows: int, interval_s: float, busy: bool, seconds: float) -> dict[str, float]:
    """One point, in this process: the step's p50 seconds, the busy thread's units a second."""
    sys.setswitchinterval(interval_s)
    scheduler = scheduler_at(rows)
    stop = threading.Event()
    units = [0]

    def loop() -> None:
        while not stop.is_set():
            total = 0
            for i in range(200):
                total += i
            units[0] += 1

    other = threading.Thread(target=loop, daemon=True)
    if busy:
        other.start()
    times: list[float] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        if len(times) % STEPS_PER_BUILD == STEPS_PER_BUILD - 1:
            scheduler = scheduler_at(rows)
        start = time.perf_counter()
        step(scheduler)
        times.append(time.perf_counter() - start)
    stop.set()
    elapsed = time.perf_counter() - began
    return {"step_p50_s": statistics.median(times), "busy_units_per_s": units[0] / elapsed}


def run_point(rows: int, interval_us: float, busy: bool, seconds: float) -> dict[str, float]:
    args = [sys.executable, "-m", "bench.serving_path.gil_handoff", "--point",
            str(rows), str(interval_us), "busy" if busy else "idle", str(seconds)]  # fmt: skip
    done = subprocess.run(args, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_path.gil_handoff")
    parser.add_argument("--rows", type=int, nargs="+", default=[400, 1000])
    parser.add_argument("--intervals-us", type=float, nargs="+", default=[5000, 500, 100, 50])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--name", default="gil_handoff_cpu")
    parser.add_argument("--out-dir", type=Path, default=results_dir("serving_path"))
    parser.add_argument("--point", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point is not None:
        rows, interval_us, mode, seconds = args.point
        figures = point(int(rows), float(interval_us) * 1e-6, mode == "busy", float(seconds))
        print(json.dumps(figures))
        return 0
    points: list[dict[str, Any]] = []
    for rows in args.rows:
        cases = [(None, False)] + [(us, True) for us in args.intervals_us]
        for interval_us, busy in cases:
            interval = interval_us or 5000
            reps = [run_point(rows, interval, busy, args.seconds) for _ in range(args.reps)]
            steps = [r["step_p50_s"] * 1e3 for r in reps]
            units = [r["busy_units_per_s"] for r in reps]
            points.append({
                "rows": rows, "busy": busy, "interval_us": interval_us,
                "step_p50_ms": statistics.median(steps), "step_p50_ms_min": min(steps),
                "step_p50_ms_max": max(steps), "busy_units_per_s": statistics.median(units),
            })  # fmt: skip
            print(points[-1], flush=True)
    table = markdown_table(
        ["rows", "beside", "switch interval", "step p50 ms (min-max)", "busy thread units/s"],
        [(p["rows"], "a busy thread" if p["busy"] else "nothing",
          f"{p['interval_us']:g} us" if p["busy"] else "-",
          f"{p['step_p50_ms']:.2f} ({p['step_p50_ms_min']:.2f}-{p['step_p50_ms_max']:.2f})",
          f"{p['busy_units_per_s']:,.0f}" if p["busy"] else "-") for p in points],
    )  # fmt: skip
    text = (
        "## The engine thread's host work beside a busy thread, by switch interval\n\n"
        f"The real scheduler's step (schedule, update, stats) over each row count, {args.reps} "
        f"runs of {args.seconds:g} s a point, each its own process.\n\n{table}\n"
    )
    command = " ".join(["python -m bench.serving_path.gil_handoff", *(argv or sys.argv[1:])])
    payload = {"points": points, "reps": args.reps, "seconds": args.seconds}
    write_results(args.name, payload, text, command, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
