"""The host time of the scheduler's step with prefix caching on against off, without a model.

The real scheduler and block manager (no torch) run N steps with `--max-num-seqs` sequences
decoding at once (1,024 by default, as in the H200 serving runs of issue 50), the per-step token
budget of those runs (8,192), short prompts (log-normal lengths, median 60 tokens) of which half
are drawn with repeats from a small pool of shared prompts (so hits happen) and half are unique,
and chat-length answers (log-normal, median 250 tokens, capped at 1,024; ShareGPT-like). The model
is replaced by a made-up token per sampled chunk. Each step is timed from `schedule` to the end of
`update` plus what the engine thread does with the cache events afterwards (take them, append
them to the site's CacheEventJournal), by time.perf_counter and by the thread's CPU time (a
machine that other work loads stretches the wall clock of a step, much less its CPU time);
building the fake sampled tokens and queueing new requests are left out. The two arms (two
schedulers, same requests, same tokens) run in lockstep in one process, one step each in turn,
so that a load that comes and goes hits both alike; the queue is kept topped up so that the
running set stays full.

    python -m bench.engine.scheduler_overhead
        (writes bench/results/engine_overhead/scheduler_overhead.{json,md})
    python -m bench.engine.scheduler_overhead --waiting 10000 --name scheduler_overhead_waiting
        (the same with 10,000 requests kept waiting: what ordering the queue costs a step)
    python -m bench.engine.scheduler_overhead --steps 20 --warmup-steps 10 --max-num-seqs 32 \
        --name scheduler_overhead_smoke --out /tmp/x                        (smoke test)

The result states per arm p50 / p99 / mean of the step's host time, the on-minus-off difference
of those (and the median of the per-step paired differences), that difference as a fraction of
a 10 ms GPU step and of the measured off step, the Python function calls per step of each arm
(a count that load on the machine does not move), and a cProfile top list of a separate
profiled run of the on arm (profiling slows it, so the timed runs are unprofiled).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.engine.chat_stream import ChatStream
from bench.engine.metrics import percentile
from site_engine.cache_event_journal import CacheEventJournal
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams

GPU_STEP_S = 0.010  # the ~10 ms GPU step the host work is compared with
VOCAB = 128_000
MODEL = "llama-3.2-1b-shape"


@dataclass(frozen=True, slots=True)
class Settings:
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    num_blocks: int = 65_536
    block_size: int = 16
    steps: int = 400
    warmup_steps: int = 300
    shared_prompts: int = 64
    repeat_fraction: float = 0.5
    seed: int = 0
    profile_steps: int = 100
    # Requests kept waiting (the queue topped up to this depth before each step); 0: a quarter
    # of max_num_seqs, enough to keep the running set full.
    waiting: int = 0


class Workload:
    """An endless stream of requests: (id, prompt, answer length), the same for every arm."""

    def __init__(self, settings: Settings) -> None:
        self._stream = ChatStream(settings.seed, settings.shared_prompts,
                                  settings.repeat_fraction, 2048, range(VOCAB))  # fmt: skip

    def next(self) -> tuple[str, tuple[int, ...], int]:
        return self._stream.next()


def _scheduler(settings: Settings, caching: bool) -> Scheduler:
    config = SchedulerConfig(
        num_blocks=settings.num_blocks,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=4096,
        prefix_caching=caching,
        model_name=MODEL,
    )
    return Scheduler(config)


class Arm:
    """One scheduler (prefix caching on or off) fed its own copy of the workload."""

    def __init__(self, settings: Settings, caching: bool) -> None:
        self.caching = caching
        self._settings = settings
        self.scheduler = _scheduler(settings, caching)
        self._journal = CacheEventJournal(settings.block_size)
        self._workload = Workload(settings)
        self._token_rng = random.Random(settings.seed + 1)
        self.wall_s: list[float] = []
        self.cpu_s: list[float] = []
        self.stats_cpu_s: list[float] = []  # scheduler.stats(), which the engine service calls
        self.running: list[int] = []

    def step(self, timed: bool, profiler: cProfile.Profile | None = None) -> None:
        """One schedule + update with made-up tokens; the host time of both kept if `timed`."""
        scheduler = self.scheduler
        waiting, _ = scheduler.queue_lengths()
        depth = self._settings.waiting or self._settings.max_num_seqs // 4
        for _ in range(max(depth - waiting, 0)):
            request_id, prompt, answer = self._workload.next()
            sampling = SamplingParams(max_tokens=answer, ignore_eos=True, temperature=0.0)
            scheduler.add(request_id, prompt, sampling)
        profiling = profiler if timed else None
        if profiling:
            profiling.enable()
        began, began_cpu = time.perf_counter(), time.thread_time()
        output = scheduler.schedule()
        scheduled, scheduled_cpu = time.perf_counter(), time.thread_time()
        if profiling:
            profiling.disable()
        rng = self._token_rng
        result = ModelRunnerOutput(
            {c.request_id: rng.randrange(VOCAB) for c in output.chunks if c.sample}
        )
        if profiling:
            profiling.enable()
        resumed, resumed_cpu = time.perf_counter(), time.thread_time()
        scheduler.update(output, result)
        events = scheduler.take_cache_events()
        if events:
            self._journal.append(events)
        ended, ended_cpu = time.perf_counter(), time.thread_time()
        if profiling:
            profiling.disable()
        if timed:
            # After the step, apart: the site's engine thread asks for it after every step.
            stats_began = time.thread_time()
            scheduler.stats()
            self.stats_cpu_s.append(time.thread_time() - stats_began)
            self.wall_s.append((scheduled - began) + (ended - resumed))
            self.cpu_s.append((scheduled_cpu - began_cpu) + (ended_cpu - resumed_cpu))
            self.running.append(scheduler.queue_lengths()[1])

    def state(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        queries = stats.prefix_cache_queries
        return {
            "running_min": min(self.running, default=0),
            "running_mean": statistics.fmean(self.running) if self.running else 0.0,
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_cached": stats.kv_blocks_cached,
            "prefix_cache_hit_fraction": stats.prefix_cache_hits / queries if queries else 0.0,
        }


def _percentile(values: Sequence[float], q: float) -> float:
    """0 where nothing was timed (an arm that never called `stats()`)."""
    return percentile(values, q) if values else 0.0


def summarize(times: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": _percentile(times, 50) * 1e3,
        "p99_ms": _percentile(times, 99) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3 if times else 0.0,
    }


def profile_arms(settings: Settings, top: int = 25) -> tuple[str, dict[str, float]]:
    """The cProfile top list (own time) of the on arm's timed steps, and the Python function
    calls per step of each arm: a count that, unlike a time, no other load on the machine moves
    (the same requests, the same decisions, the same calls)."""
    listing = ""
    calls: dict[str, float] = {}
    for name, caching in (("off", False), ("on", True)):
        profiler = cProfile.Profile()
        arm = Arm(settings, caching=caching)
        for step in range(settings.warmup_steps + settings.profile_steps):
            arm.step(step >= settings.warmup_steps, profiler)
        # From the raw entries, one per code object: pstats merges functions of one name and
        # line (every dataclass's generated __init__), which would lose calls.
        total = sum(entry.callcount for entry in profiler.getstats())
        calls[name] = total / settings.profile_steps
        stats = pstats.Stats(profiler)
        if caching:
            text = io.StringIO()
            stats.stream = text  # type: ignore[attr-defined]
            stats.sort_stats("tottime").print_stats(top)
            listing = text.getvalue()
    calls["on_minus_off"] = calls["on"] - calls["off"]
    return listing, calls


def measure(settings: Settings) -> dict[str, Any]:
    """Both arms in lockstep, one step each in turn (which goes first alternates): a machine
    that others load slows both alike, and the per-step differences pair steps of one moment."""
    arms = {"off": Arm(settings, caching=False), "on": Arm(settings, caching=True)}
    for step in range(settings.warmup_steps + settings.steps):
        timed = step >= settings.warmup_steps
        order = ("off", "on") if step % 2 == 0 else ("on", "off")
        for name in order:
            arms[name].step(timed)
    result: dict[str, Any] = {}
    for name, arm in arms.items():
        result[name] = {
            **summarize(arm.wall_s),
            "thread_cpu": summarize(arm.cpu_s),
            "stats_thread_cpu": summarize(arm.stats_cpu_s),
            "steps": len(arm.wall_s),
            **arm.state(),
        }
    off, on = result["off"], result["on"]
    paired = [a - b for a, b in zip(arms["on"].wall_s, arms["off"].wall_s, strict=True)]
    paired_cpu = [a - b for a, b in zip(arms["on"].cpu_s, arms["off"].cpu_s, strict=True)]
    diff = {key: on[key] - off[key] for key in ("p50_ms", "p99_ms", "mean_ms")}
    diff_cpu = {key: on["thread_cpu"][key] - off["thread_cpu"][key] for key in diff}
    result["on_minus_off"] = {
        **diff,
        "paired_p50_ms": _percentile(paired, 50) * 1e3,
        "thread_cpu": {**diff_cpu, "paired_p50_ms": _percentile(paired_cpu, 50) * 1e3},
        "p50_of_10ms_gpu_step": diff["p50_ms"] / (GPU_STEP_S * 1e3),
        "p50_of_off_step": diff["p50_ms"] / off["p50_ms"] if off["p50_ms"] else 0.0,
        "thread_cpu_p50_of_10ms_gpu_step": diff_cpu["p50_ms"] / (GPU_STEP_S * 1e3),
        "thread_cpu_p50_of_off_step": (
            diff_cpu["p50_ms"] / off["thread_cpu"]["p50_ms"] if off["thread_cpu"]["p50_ms"] else 0
        ),
    }
    return result


def markdown(settings: Settings, result: dict[str, Any], profile: str) -> str:
    calls = result["python_calls_per_step"]
    rows = []
    for name in ("off", "on"):
        arm = result[name]
        cpu = arm["thread_cpu"]
        rows.append([name, arm["steps"], arm["p50_ms"], arm["p99_ms"], arm["mean_ms"],
                     cpu["p50_ms"], cpu["p99_ms"], arm["running_min"]])  # fmt: skip
    diff = result["on_minus_off"]
    cpu = diff["thread_cpu"]
    rows.append(["on - off", "", diff["p50_ms"], diff["p99_ms"], diff["mean_ms"],
                 cpu["p50_ms"], cpu["p99_ms"], ""])  # fmt: skip
    table = markdown_table(
        ["prefix cache", "steps", "p50 ms", "p99 ms", "mean ms", "CPU p50 ms", "CPU p99 ms",
         "running (min)"],
        rows,
    )  # fmt: skip
    return (
        f"Settings: {settings}\n\nPer-step host time (schedule + update + cache events to the "
        "journal; wall clock by time.perf_counter, CPU = the thread's CPU time, which a loaded "
        f"machine inflates less), both arms in lockstep:\n\n{table}\n\n"
        f"On minus off, p50: **{diff['p50_of_10ms_gpu_step']:.1%} of a 10 ms GPU step**, "
        f"{diff['p50_of_off_step']:.1%} of the measured off step (thread CPU time: "
        f"{diff['thread_cpu_p50_of_10ms_gpu_step']:.1%} of 10 ms, "
        f"{diff['thread_cpu_p50_of_off_step']:.1%} of the off step); the median of the "
        f"per-step paired differences: {diff['paired_p50_ms']:.3f} ms wall, "
        f"{cpu['paired_p50_ms']:.3f} ms CPU. Prompt tokens found cached (on): "
        f"{result['on']['prefix_cache_hit_fraction']:.1%}.\n\n"
        "scheduler.stats() after a step (the engine service calls it after every step; not in "
        "the step's time above), thread CPU p50: off "
        f"{result['off']['stats_thread_cpu']['p50_ms']:.3f} ms, on "
        f"{result['on']['stats_thread_cpu']['p50_ms']:.3f} ms.\n\n"
        f"Python function calls per step (cProfile's count, which load does not move): off "
        f"{calls['off']:,.0f}, on {calls['on']:,.0f}, on - off **{calls['on_minus_off']:,.0f}**."
        "\n\n"
        f"cProfile of the on arm ({settings.profile_steps} steps, by own time):\n\n"
        f"```\n{profile.strip()}\n```\n"
    )


def main(argv: Sequence[str] | None = None) -> Path:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "block_size", "steps",
                 "warmup_steps", "shared_prompts", "seed", "profile_steps", "waiting"):  # fmt: skip
        flag = f"--{name.replace('_', '-')}"
        parser.add_argument(flag, type=int, default=getattr(defaults, name))
    parser.add_argument("--repeat-fraction", type=float, default=defaults.repeat_fraction)
    parser.add_argument("--name", default="scheduler_overhead")
    parser.add_argument("--out", type=Path, default=results_dir("engine_overhead"))
    args = parser.parse_args(argv)
    settings = Settings(**{k: v for k, v in vars(args).items() if k not in ("name", "out")})
    result = measure(settings)
    profile, calls = profile_arms(settings)
    result["python_calls_per_step"] = calls
    payload = {"settings": asdict(settings), **result, "profile_on": profile}
    command = command_line("bench.engine.scheduler_overhead", argv)
    path = write_results(args.name, payload, markdown(settings, result, profile), command, args.out)
    diff = result["on_minus_off"]
    cpu = diff["thread_cpu"]
    print(f"on-off p50 {diff['p50_ms']:.3f} ms wall, {cpu['p50_ms']:.3f} ms thread CPU "
          f"({diff['thread_cpu_p50_of_10ms_gpu_step']:.1%} of 10 ms); {path}")  # fmt: skip
    return path


if __name__ == "__main__":
    main()
