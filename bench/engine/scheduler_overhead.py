"""The host time of the scheduler's step with prefix caching on against off, without a model.

The real scheduler and block manager (no torch) run N steps with `--max-num-seqs` sequences
decoding at once (1,024 by default, as in the H200 serving runs of issue 50), the per-step token
budget of those runs (8,192), short prompts (log-normal lengths, median 60 tokens) of which half
are drawn with repeats from a small pool of shared prompts (so hits happen) and half are unique,
and chat-length answers (log-normal, median 250 tokens, capped at 1,024; ShareGPT-like). The model
is replaced by a made-up token per sampled chunk. Each step is timed with time.perf_counter from
`schedule` to the end of `update` plus what the engine thread does with the cache events
afterwards (take them, append them to the site's CacheEventJournal); building the fake sampled
tokens and queueing new requests are left out. Both arms run the same requests and the same
tokens; the queue is kept topped up so that the running set stays full.

    python -m bench.engine.scheduler_overhead
        (writes bench/results/engine_overhead/scheduler_overhead.{json,md})
    python -m bench.engine.scheduler_overhead --steps 20 --warmup-steps 10 --max-num-seqs 32 \
        --name scheduler_overhead_smoke --out /tmp/x                        (smoke test)

The result states per arm p50 / p99 / mean of the step's host time, the on-minus-off difference
of those, that difference as a fraction of a 10 ms GPU step and of the measured off step, and a
cProfile top list of a separate profiled run of the on arm (profiling slows it, so the timed
runs are unprofiled).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import command_line, markdown_table, results_dir, write_results
from site_engine.cache_event_journal import CacheEventJournal
from site_engine.engine.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.types import ModelRunnerOutput, SamplingParams

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


def _lognormal(rng: random.Random, median: float, p99: float, cap: int) -> int:
    sigma = math.log(p99 / median) / 2.3263478740408408
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


class Workload:
    """An endless stream of requests: (prompt, answer length), the same for every arm."""

    def __init__(self, settings: Settings) -> None:
        self._rng = random.Random(settings.seed)
        self._repeat = settings.repeat_fraction
        self._shared = [self._prompt() for _ in range(settings.shared_prompts)]
        self._count = 0

    def _prompt(self) -> tuple[int, ...]:
        length = _lognormal(self._rng, 60, 600, 2048)
        return tuple(self._rng.randrange(VOCAB) for _ in range(length))

    def next(self) -> tuple[str, tuple[int, ...], int]:
        self._count += 1
        shared = self._rng.random() < self._repeat
        prompt = self._rng.choice(self._shared) if shared else self._prompt()
        return f"r{self._count}", prompt, _lognormal(self._rng, 250, 1024, 1024)


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


def run_arm(
    settings: Settings, caching: bool, steps: int, profiler: cProfile.Profile | None = None
) -> dict[str, Any]:
    """Warm up, then time `steps` steps; per-step host times in seconds and the end state."""
    scheduler = _scheduler(settings, caching)
    journal = CacheEventJournal(settings.block_size)
    workload = Workload(settings)
    token_rng = random.Random(settings.seed + 1)
    times: list[float] = []
    running: list[int] = []
    for step in range(settings.warmup_steps + steps):
        waiting, _ = scheduler.queue_lengths()
        for _ in range(max(settings.max_num_seqs // 4 - waiting, 0)):
            request_id, prompt, answer = workload.next()
            sampling = SamplingParams(max_tokens=answer, ignore_eos=True, temperature=0.0)
            scheduler.add(request_id, prompt, sampling)
        timed = step >= settings.warmup_steps
        if timed and profiler is not None:
            profiler.enable()
        began = time.perf_counter()
        output = scheduler.schedule()
        scheduled = time.perf_counter()
        if timed and profiler is not None:
            profiler.disable()
        sampled = {c.request_id: token_rng.randrange(VOCAB) for c in output.chunks if c.sample}
        result = ModelRunnerOutput(sampled)
        if timed and profiler is not None:
            profiler.enable()
        resumed = time.perf_counter()
        scheduler.update(output, result)
        events = scheduler.take_cache_events()
        if events:
            journal.append(events)
        ended = time.perf_counter()
        if timed and profiler is not None:
            profiler.disable()
        if timed:
            times.append((scheduled - began) + (ended - resumed))
            running.append(scheduler.queue_lengths()[1])
    stats = scheduler.stats()
    return {
        "times_s": times,
        "running_min": min(running, default=0),
        "running_mean": statistics.fmean(running) if running else 0.0,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_cached": stats.kv_blocks_cached,
        "prefix_cache_hit_fraction": (
            stats.prefix_cache_hits / stats.prefix_cache_queries
            if stats.prefix_cache_queries
            else 0.0
        ),
    }


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(times: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": _percentile(times, 50) * 1e3,
        "p99_ms": _percentile(times, 99) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3 if times else 0.0,
    }


def profile_on_arm(settings: Settings, top: int = 25) -> str:
    """The cProfile top list (cumulative time) of the on arm's timed part."""
    profiler = cProfile.Profile()
    run_arm(settings, True, settings.profile_steps, profiler)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def measure(settings: Settings) -> dict[str, Any]:
    # Off, on, off, on: the second pair catches a machine that got slower in between.
    arms: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for caching in (False, True, False, True):
        arms["on" if caching else "off"].append(run_arm(settings, caching, settings.steps))
    result: dict[str, Any] = {}
    for name, runs in arms.items():
        times = [t for run in runs for t in run.pop("times_s")]
        result[name] = {**summarize(times), "runs": runs, "steps": len(times)}
    off, on = result["off"], result["on"]
    diff = {key: on[key] - off[key] for key in ("p50_ms", "p99_ms", "mean_ms")}
    result["on_minus_off"] = {
        **diff,
        "p50_of_10ms_gpu_step": diff["p50_ms"] / (GPU_STEP_S * 1e3),
        "p50_of_off_step": diff["p50_ms"] / off["p50_ms"] if off["p50_ms"] else 0.0,
        "mean_of_10ms_gpu_step": diff["mean_ms"] / (GPU_STEP_S * 1e3),
    }
    return result


def markdown(settings: Settings, result: dict[str, Any], profile: str) -> str:
    rows = [
        [name, result[name]["steps"], result[name]["p50_ms"], result[name]["p99_ms"],
         result[name]["mean_ms"], result[name]["runs"][0]["running_min"]]
        for name in ("off", "on")
    ]  # fmt: skip
    diff = result["on_minus_off"]
    rows.append(["on - off", "", diff["p50_ms"], diff["p99_ms"], diff["mean_ms"], ""])
    table = markdown_table(
        ["prefix cache", "steps", "p50 ms", "p99 ms", "mean ms", "running (min)"], rows
    )
    hit = result["on"]["runs"][0]["prefix_cache_hit_fraction"]
    return (
        f"Settings: {settings}\n\nPer-step host time (schedule + update + cache events to the "
        f"journal), two runs per arm interleaved:\n\n{table}\n\n"
        f"On minus off, p50: **{diff['p50_of_10ms_gpu_step']:.1%} of a 10 ms GPU step**, "
        f"{diff['p50_of_off_step']:.1%} of the measured off step; mean: "
        f"{diff['mean_of_10ms_gpu_step']:.1%} of 10 ms. Prompt tokens found cached (on): "
        f"{hit:.1%}.\n\ncProfile of the on arm ({settings.profile_steps} steps, by own time):\n\n"
        f"```\n{profile.strip()}\n```\n"
    )


def main(argv: Sequence[str] | None = None) -> Path:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "block_size", "steps",
                 "warmup_steps", "shared_prompts", "seed", "profile_steps"):  # fmt: skip
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--repeat-fraction", type=float, default=defaults.repeat_fraction)
    parser.add_argument("--name", default="scheduler_overhead")
    parser.add_argument("--out", type=Path, default=results_dir("engine_overhead"))
    args = parser.parse_args(argv)
    settings = Settings(**{k: v for k, v in vars(args).items() if k not in ("name", "out")})
    result = measure(settings)
    profile = profile_on_arm(settings)
    payload = {"settings": asdict(settings), **result, "profile_on": profile}
    command = command_line("bench.engine.scheduler_overhead", argv)
    path = write_results(args.name, payload, markdown(settings, result, profile), command, args.out)
    diff = result["on_minus_off"]
    print(f"off p50 {result['off']['p50_ms']:.2f} ms, on p50 {result['on']['p50_ms']:.2f} ms, "
          f"on-off {diff['p50_ms']:.2f} ms = {diff['p50_of_10ms_gpu_step']:.1%} of 10 ms; {path}")  # fmt: skip
    return path


if __name__ == "__main__":
    main()
