"""This engine's runs in the GPU engine benchmark: a PagedEngine driven over a trace.

This module owns phases 3 to 5 of a run, the measurements of the engine itself: a fresh
PagedEngine per run, warmed up with a few short requests, then fed the trace's requests in
process, each when its arrival time has come (all at t=0 for a burst, the whole trace or the
subset the transformers baselines run; Poisson arrival times otherwise), and stepped until every
request is done or the run's budget ends. Every token's time is recorded, with the peak of the
KV blocks in use, and summarised by bench.engine.metrics.summarize_run.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench.engine.harness import GIB, Progress, free_device_memory, sync
from bench.engine.metrics import RequestTiming, RunSummary, summarize_run
from bench.engine.roofline import kv_block_bytes
from fedsim.engine_trace import WorkloadRequest
from site_engine.engine.core.api import EngineRequest, RequestRejected
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel


def _used_blocks_probe(engine: PagedEngine) -> tuple[Callable[[], int], str]:
    """Reading blocks in use every step: engine.stats() walks every queued sequence (a few ms
    with a thousand waiting), so the scheduler's block manager is read when it is there and
    agrees with stats(); otherwise stats() is called every step."""
    blocks: Any = getattr(getattr(engine, "_scheduler", None), "block_manager", None)
    value = getattr(blocks, "num_used_blocks", None)
    if isinstance(value, int) and value == engine.stats().kv_blocks_used:
        return (lambda: int(blocks.num_used_blocks)), "block manager, every step"
    return (lambda: engine.stats().kv_blocks_used), "engine.stats(), every step"


def warm_up(engine: PagedEngine, vocab: int, count: int, seed: int) -> None:
    """A few short requests through the engine, so first-call costs stay out of the run."""
    rng = random.Random(seed)
    for i in range(count):
        prompt = tuple(rng.randrange(vocab) for _ in range(16 + 24 * i))
        engine.add_request(
            EngineRequest(
                f"warmup-{i}",
                prompt,
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            )
        )
    while engine.has_unfinished():
        engine.step()


def engine_config(args: argparse.Namespace, max_num_seqs: int | None = None) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=max_num_seqs or args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_bytes=int(args.kv_cache_gib * GIB),
    )


@dataclass(slots=True)
class _DriveCounts:
    """What the step loop of one run counted."""

    wall_s: float
    steps: int
    rejected: int
    sampled: int
    peak_blocks: int
    truncated: bool


def run_engine(
    loaded: LoadedModel,
    requests: Sequence[WorkloadRequest],
    config: EngineConfig,
    *,
    name: str,
    arrivals: Sequence[float] | None,
    poisson_rate: float | None,
    budget_s: float,
    log: Progress,
    seed: int,
    warmup_requests: int,
) -> tuple[RunSummary, dict[str, Any]]:
    """Drives a fresh PagedEngine in-process: adds each request when its arrival time has come
    (all at t=0 for a burst) and calls step() until every request is done or the budget ends."""
    engine = PagedEngine(loaded, config)
    try:
        warmup_count = min(warmup_requests, config.max_num_seqs)
        warm_up(engine, len(loaded.tokenizer), warmup_count, seed)
        summary, extra = measure_run(
            engine,
            loaded,
            requests,
            config,
            name=name,
            arrivals=arrivals,
            poisson_rate=poisson_rate,
            budget_s=budget_s,
            log=log,
        )
        extra["warmup_requests"] = warmup_count
        return summary, extra
    finally:
        del engine
        free_device_memory(loaded.device)


def measure_run(
    engine: PagedEngine,
    loaded: LoadedModel,
    requests: Sequence[WorkloadRequest],
    config: EngineConfig,
    *,
    name: str,
    arrivals: Sequence[float] | None,
    poisson_rate: float | None,
    budget_s: float,
    log: Progress,
    sample_queue: bool = False,
) -> tuple[RunSummary, dict[str, Any]]:
    """One run of `requests` through an idle, warmed-up engine (see run_engine). With
    `sample_queue` the waiting requests are counted after every step (the queue depth)."""
    device = loaded.device
    times = list(arrivals) if arrivals is not None else [0.0] * len(requests)
    limits = engine.limits
    base = engine.stats()
    probe, probe_method = _used_blocks_probe(engine)
    waiting: list[int] = []
    if sample_queue:
        blocks_probe = probe

        def probe() -> int:
            waiting.append(engine.queue_lengths()[0])
            return blocks_probe()

    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timings = _timings(requests, times)
    counts = _drive(engine, requests, times, timings, name, budget_s, probe, log)
    stats = engine.stats()
    max_allocated = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    summary = summarize_run(
        name,
        list(timings.values()),
        arrival="burst" if arrivals is None else "poisson",
        poisson_rate=poisson_rate,
        wall_s=counts.wall_s,
        steps=counts.steps,
        rejected=counts.rejected,
        truncated=counts.truncated,
        preemptions=stats.num_preemptions - base.num_preemptions,
        kv_block_bytes=kv_block_bytes(loaded, config.block_size),
        kv_blocks_total=limits.kv_blocks_total,
        peak_kv_blocks=counts.peak_blocks,
        max_memory_allocated_bytes=max_allocated,
        mean_running=counts.sampled / counts.steps if counts.steps else 0.0,
        queue_depths=waiting,
    )
    extra = {
        "engine_config": asdict(config),
        "engine_name": limits.name,
        "kv_capacity_bytes": limits.kv_blocks_total * summary.kv_block_bytes,
        "kv_peak_sampling": probe_method,
        "mean_running_meaning": "mean number of sequences that produced a token per step",
        "budget_s": budget_s,
    }
    return summary, extra


def _timings(requests: Sequence[WorkloadRequest], times: list[float]) -> dict[str, RequestTiming]:
    """An empty RequestTiming per request, by request id, in arrival order."""
    return {
        r.request_id: RequestTiming(
            request_id=r.request_id,
            arrival_s=t,
            expected_tokens=r.output_tokens,
            prompt_tokens=len(r.prompt_token_ids),
        )
        for r, t in zip(requests, times, strict=True)
    }


def _drive(
    engine: PagedEngine,
    requests: Sequence[WorkloadRequest],
    times: list[float],
    timings: dict[str, RequestTiming],
    name: str,
    budget_s: float,
    probe: Callable[[], int],
    log: Progress,
) -> _DriveCounts:
    """The step loop of run_engine: submits each request when its arrival time has come, steps
    the engine and records every token's time, until all are done or the budget ends."""
    total = len(requests)
    next_index = steps = rejected = sampled = peak_blocks = finished = produced = 0
    truncated = False
    started = time.perf_counter()
    last_log = started
    while True:
        now = time.perf_counter() - started
        next_index, rejected = _submit_due(
            engine, requests, times, timings, next_index, now, rejected, name, log
        )
        if now > budget_s:
            truncated = True
            break
        if not engine.has_unfinished():
            if next_index >= total:
                break
            wait = times[next_index] - (time.perf_counter() - started)
            if wait > 0:
                time.sleep(min(wait, max(budget_s - now, 0.0) + 0.01))
            continue
        outputs = engine.step()
        steps += 1
        stamp = time.perf_counter() - started
        peak_blocks = max(peak_blocks, probe())
        sampled += len(outputs)
        for output in outputs:
            timing = timings.get(output.request_id)
            if timing is None:
                continue
            timing.record_tokens(stamp, len(output.new_token_ids))
            produced += len(output.new_token_ids)
            if output.finish_reason is not None and timing.finish_s is None:
                timing.finish_s = stamp
                finished += 1
        if stamp + started - last_log > 15.0:
            last_log = stamp + started
            log(
                f"  {name}: {finished}/{total} done, {next_index} submitted, "
                f"{produced} tokens, {steps} steps, {produced / max(stamp, 1e-9):.0f} tok/s"
            )
    wall = time.perf_counter() - started
    return _DriveCounts(wall, steps, rejected, sampled, peak_blocks, truncated)


def _submit_due(
    engine: PagedEngine,
    requests: Sequence[WorkloadRequest],
    times: list[float],
    timings: dict[str, RequestTiming],
    next_index: int,
    now: float,
    rejected: int,
    name: str,
    log: Progress,
) -> tuple[int, int]:
    """Adds every request whose arrival time has come by `now`; returns the next request's
    index and the count of rejected requests so far."""
    total = len(requests)
    while next_index < total and times[next_index] <= now:
        request = requests[next_index]
        timings[request.request_id].submitted_s = now
        try:
            engine.add_request(
                EngineRequest(
                    request.request_id,
                    request.prompt_token_ids,
                    SamplingParams(
                        max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True
                    ),
                )
            )
        except RequestRejected as exc:
            rejected += 1
            if rejected == 1:
                log(f"  {name}: request rejected: {exc}")
        next_index += 1
    return next_index, rejected
