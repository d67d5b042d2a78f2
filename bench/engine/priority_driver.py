"""The priority benchmark's step loop (bench/engine/priority.py): requests added when their
arrival time comes, the engine stepped, every token's time kept.

Two clocks. The GPU preset runs on the wall clock. The CPU preset runs on a token clock: each
step costs `base_s + per_token_s * tokens it computed` (prompt positions plus one per sampled
token), a GPU-like step whose time grows with its prefill, so the tiny model's numbers are
deterministic on a shared CPU and the deferral bound shows. The token clock does not see the
recompute of generated tokens after a preemption (prompt_tokens_computed counts prompt
positions only), so it under-charges preemptions a little; the wall clock charges them all.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.engine.metrics import percentile
from bench.engine.presets import Clock
from fedllm_contract.priority import Priority
from site_engine.engine.core.api import EngineRequest, RequestOutput
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import PagedEngine


@dataclass(frozen=True, slots=True)
class Shape:
    """Prompt and answer lengths, each drawn uniformly from its [low, high]."""

    prompt: tuple[int, int]
    answer: tuple[int, int]


def make_requests(
    name: str, count: int, shape: Shape, priority: Priority, vocab: int, seed: int
) -> list[EngineRequest]:
    """Random-token prompts (no prefix in common), greedy, answers of exact lengths."""
    rng = random.Random(seed)
    return [
        EngineRequest(
            f"{name}-{n}",
            tuple(rng.randrange(1, vocab) for _ in range(rng.randint(*shape.prompt))),
            SamplingParams(max_tokens=rng.randint(*shape.answer), temperature=0.0, ignore_eos=True),
            priority=priority,
        )
        for n in range(count)
    ]


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


@dataclass(slots=True)
class _Timing:
    arrival_s: float
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    cached: int = 0  # prompt tokens its admission found in the prefix cache


@dataclass(slots=True)
class RunResult:
    """What one run measured: interactive latencies, batch tokens within the window."""

    clock_s: float
    steps: int
    interactive_done: int
    interactive_total: int
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    batch_tokens_in_window: int = 0
    interactive_tokens_in_window: int = 0
    # Prompt tokens of interactive requests served from the prefix cache: 0 with random prompts
    # and a cache cleared at the run's start (drive says why).
    interactive_cached_prompt_tokens: int = 0
    preemptions: dict[str, int] = field(default_factory=dict)
    # The step cost the engine had learned by the run's end (base, per token, per KV position
    # read, in seconds; empty before it learned one): what the time side bounded the batch by.
    step_cost_s: tuple[float, ...] = ()

    def p99(self, values: list[float]) -> float | None:
        return self.percentile(values, 99)

    def percentile(self, values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None


def drive(
    engine: PagedEngine,
    interactive: list[tuple[float, EngineRequest]],
    batch: list[EngineRequest],
    clock: Clock,
    window_s: float,
    drain_s: float,
    batch_queue: int,
) -> RunResult:
    """The batch queued at t=0, interactive requests at their arrival times; stepped until
    every interactive request is done (or `window_s + drain_s` passes); batch tokens count
    while the window lasts; what is left afterwards is cancelled.

    The batch waits here, as the gateway keeps a batch (issue 52: it feeds each site just
    enough background work), and the engine's queue is topped up to `batch_queue` waiting
    requests before every step: always more than it can admit, never the whole batch (the
    scheduler sorts its queue every step, which a site is not meant to hold thousands in).

    The run starts from an empty prefix cache. The `alone` and `with_batch` runs of a seed replay
    the same interactive prompts on one engine, and a cache that kept the first run's blocks
    served the second run's prompts without their prefill (issue 60: on an H200, whose cache held
    the whole first run, chat beside the batch had a TTFT p99 of ~24 ms, the latency of a step
    with no prefill, against 80-200 ms alone)."""
    engine.clear_prefix_cache()
    feed = iter(batch)
    pending = sorted(interactive, key=lambda pair: pair[0])
    timings = {request.request_id: _Timing(t) for t, request in pending}
    result = RunResult(0.0, 0, 0, len(pending))
    before = {load.priority: load.num_preemptions for load in engine.stats().by_class}
    next_arrival = 0
    computed = engine.scheduler_stats().prompt_tokens_computed
    while True:
        now = clock.now()
        interactive_left = next_arrival < len(pending) or result.interactive_done < len(pending)
        if now > window_s + drain_s or not (interactive_left or (batch and now < window_s)):
            break
        while next_arrival < len(pending) and pending[next_arrival][0] <= now:
            engine.add_request(pending[next_arrival][1])
            next_arrival += 1
        for _ in range(batch_queue - engine.queue_lengths()[0]):
            request = next(feed, None)
            if request is not None:
                engine.add_request(request)
        if not engine.has_unfinished():
            if next_arrival == len(pending):
                break  # everything done, the batch too (it was smaller than the window)
            clock.idle_until(pending[next_arrival][0])
            continue
        outputs = engine.step()
        prompt_tokens = engine.scheduler_stats().prompt_tokens_computed
        _stepped(engine, clock, prompt_tokens - computed, outputs)
        computed = prompt_tokens
        result.steps += 1
        t = clock.now()
        for output in outputs:
            timing = timings.get(output.request_id)
            in_window = t <= window_s
            if timing is None:
                result.batch_tokens_in_window += len(output.new_token_ids) * in_window
                continue
            result.interactive_tokens_in_window += len(output.new_token_ids) * in_window
            if output.new_token_ids:
                if timing.first_s is None:
                    timing.first_s = t
                    timing.cached = output.cached_prompt_tokens
                timing.last_s = t
                timing.tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                result.interactive_done += 1
    result.clock_s = clock.now()
    _finish(engine, timings, result, before)
    for request in batch:
        engine.abort(request.request_id, FinishReason.CANCELLED)  # False for finished ones
    while engine.has_unfinished():
        engine.step()
    return result


def _finish(
    engine: PagedEngine,
    timings: dict[str, _Timing],
    result: RunResult,
    before: dict[Priority, int],
) -> None:
    """Latencies of the interactive requests (unfinished ones cancelled), preemptions."""
    for request_id, timing in timings.items():
        if timing.first_s is None or timing.last_s is None:
            engine.abort(request_id, FinishReason.CANCELLED)
            continue
        result.ttft_s.append(timing.first_s - timing.arrival_s)
        result.interactive_cached_prompt_tokens += timing.cached
        if timing.tokens > 1:
            result.tpot_s.append((timing.last_s - timing.first_s) / (timing.tokens - 1))
    stats = engine.stats()
    result.preemptions = {
        load.priority.label: load.num_preemptions - before.get(load.priority, 0)
        for load in stats.by_class
    }
    result.step_cost_s = stats.step_cost_s


def burst(engine: PagedEngine, requests: list[EngineRequest], clock: Clock) -> tuple[float, float]:
    """(requests, output tokens) per second the engine finishes when all of `requests` arrive
    at once: its capacity for that shape of work."""
    start = clock.now()
    for request in requests:
        engine.add_request(request)
    computed = engine.scheduler_stats().prompt_tokens_computed
    while engine.has_unfinished():
        outputs = engine.step()
        prompt_tokens = engine.scheduler_stats().prompt_tokens_computed
        _stepped(engine, clock, prompt_tokens - computed, outputs)
        computed = prompt_tokens
    elapsed = max(clock.now() - start, 1e-9)
    return len(requests) / elapsed, sum(r.sampling.max_tokens for r in requests) / elapsed


def _stepped(
    engine: PagedEngine, clock: Clock, prefilled: int, outputs: Sequence[RequestOutput]
) -> None:
    """Advances the clock by the step just run; a clock of its own tells the engine what the
    step took (the step cost the deferral bound's time side learns, step_cost.py)."""
    seconds = clock.stepped(prefilled + sum(len(o.new_token_ids) for o in outputs))
    if seconds is not None:
        engine.record_step_seconds(seconds)
