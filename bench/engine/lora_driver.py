"""The LoRA benchmark's pieces (bench/engine/lora.py): random PEFT adapters on disk, ShareGPT-like
requests with Zipf(1) adapter popularity, an open-loop run with per-request SLO goodput, and a
timed decode step.

Adapters: `distinct` random weight files in PEFT's layout are written once; adapter i's
directory holds its own adapter_config.json and a hard link to weight file i % distinct. The
engine reads every adapter from its own directory (its own host copy and slot), so the loading
and slot traffic of 1,000 adapters is real; only their bytes repeat (1,000 distinct rank-16
adapters of an 8B model would be 84 GB, more than the GPU machine's disk).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.engine.harness import Progress
from bench.engine.metrics import percentile
from bench.engine.priority_driver import poisson_arrivals
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.lora.adapter import PROJECTIONS, WEIGHTS_FILE, BaseShapes
from site_engine.engine.lora.random_adapter import write_config, write_random_adapter
from site_engine.engine.paged_engine import PagedEngine

# How long fill_decoding waits for every row to decode (adapters read from disk first).
FILL_TIMEOUT_S = 600.0

_Z99 = 2.326  # the standard normal's 99th percentile


def adapter_names(count: int) -> list[str]:
    return [f"a{i:04d}" for i in range(count)]


def write_adapters(root: Path, base: BaseShapes, count: int, distinct: int, rank: int) -> None:
    """`count` adapters named adapter_names(count) in `root` (kept if already there)."""
    weights = root / ".weights"
    for i in range(min(distinct, count)):
        source = weights / f"w{i}"
        if not (source / WEIGHTS_FILE).is_file():
            write_random_adapter(source, base, rank, 2 * rank, PROJECTIONS, seed=i, scale=0.02)
    for i, name in enumerate(adapter_names(count)):
        target = root / name
        if (target / WEIGHTS_FILE).is_file():
            continue
        write_config(target, rank, 2 * rank, PROJECTIONS)
        os.link(weights / f"w{i % distinct}" / WEIGHTS_FILE, target / WEIGHTS_FILE)


def lognormal(rng: random.Random, median: int, p99: int, cap: int) -> int:
    sigma = math.log(p99 / median) / _Z99
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


@dataclass(frozen=True, slots=True)
class Lengths:
    """ShareGPT-like lognormal prompt and answer lengths: (median, p99, cap) each."""

    prompt: tuple[int, int, int]
    answer: tuple[int, int, int]


def make_requests(
    count: int, lengths: Lengths, vocab: int, seed: int, prefix: str = "req"
) -> list[EngineRequest]:
    """Random-token prompts (no prefix in common), greedy, answers of exact lengths."""
    rng = random.Random(seed)
    return [
        EngineRequest(
            f"{prefix}-{n}",
            tuple(rng.randrange(1, vocab) for _ in range(lognormal(rng, *lengths.prompt))),
            SamplingParams(
                max_tokens=lognormal(rng, *lengths.answer), temperature=0.0, ignore_eos=True
            ),
        )
        for n in range(count)
    ]


def zipf_choices(names: Sequence[str], count: int, seed: int) -> list[str]:
    """`count` draws from `names` with Zipf(1) popularity: the k-th name weighted 1/k."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(len(names))]
    return rng.choices(list(names), weights=weights, k=count)


def with_adapters(
    requests: Sequence[EngineRequest], adapters: Sequence[str | None], tag: str
) -> list[EngineRequest]:
    return [
        EngineRequest(f"{tag}-{r.request_id}", r.prompt_token_ids, r.sampling, adapter=a)
        for r, a in zip(requests, adapters, strict=True)
    ]


@dataclass(slots=True)
class _Timing:
    arrival_s: float
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    done: bool = False


@dataclass(slots=True)
class ArmResult:
    requests: int
    window_s: float
    timings: list[_Timing] = field(default_factory=list)
    steps: int = 0
    elapsed_s: float = 0.0

    def goodput_rps(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """Requests finished within both SLOs, per second of arrivals."""
        good = sum(
            1
            for t in self.timings
            if t.done and t.first_s is not None and t.last_s is not None
            and t.first_s - t.arrival_s <= ttft_slo_s
            and (t.tokens < 2 or (t.last_s - t.first_s) / (t.tokens - 1) <= tpot_slo_s)
        )  # fmt: skip
        return good / self.window_s

    def summary(self, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, float | int | None]:
        ttft = [t.first_s - t.arrival_s for t in self.timings if t.first_s is not None]
        tpot = [
            (t.last_s - t.first_s) / (t.tokens - 1)
            for t in self.timings
            if t.first_s is not None and t.last_s is not None and t.tokens > 1
        ]
        tokens = sum(t.tokens for t in self.timings)
        ms = 1000.0
        return {
            "requests": self.requests,
            "finished": sum(t.done for t in self.timings),
            "goodput_rps": self.goodput_rps(ttft_slo_s, tpot_slo_s),
            "output_tok_s": tokens / self.elapsed_s if self.elapsed_s else None,
            "ttft_p50_ms": percentile(ttft, 50) * ms if ttft else None,
            "ttft_p99_ms": percentile(ttft, 99) * ms if ttft else None,
            "tpot_p50_ms": percentile(tpot, 50) * ms if tpot else None,
            "tpot_p99_ms": percentile(tpot, 99) * ms if tpot else None,
            "steps": self.steps,
            "elapsed_s": self.elapsed_s,
        }


def drive(
    engine: PagedEngine,
    arrivals: Sequence[tuple[float, EngineRequest]],
    window_s: float,
    drain_s: float,
) -> ArmResult:
    """Requests added at their arrival times (wall clock), the engine stepped until all finish
    or `window_s + drain_s` passes; what is left is cancelled."""
    timings = {r.request_id: _Timing(t) for t, r in arrivals}
    result = ArmResult(len(arrivals), window_s, list(timings.values()))
    start = time.perf_counter()
    index, done = 0, 0
    while done < len(arrivals):
        now = time.perf_counter() - start
        if now > window_s + drain_s:
            break
        while index < len(arrivals) and arrivals[index][0] <= now:
            engine.add_request(arrivals[index][1])
            index += 1
        if not engine.has_unfinished():
            if index < len(arrivals):
                time.sleep(max(0.0, min(arrivals[index][0] - now, 0.005)))
            continue
        outputs = engine.step()
        result.steps += 1
        t = time.perf_counter() - start
        for output in outputs:
            timing = timings[output.request_id]
            if output.new_token_ids:
                timing.first_s = timing.first_s if timing.first_s is not None else t
                timing.last_s = t
                timing.tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                timing.done = True
                done += 1
    result.elapsed_s = time.perf_counter() - start
    cancel_rest(engine, [r for _, r in arrivals])
    return result


def cancel_rest(engine: PagedEngine, requests: Sequence[EngineRequest]) -> None:
    """Cancels what of `requests` is unfinished and steps the engine until it is idle."""
    for request in requests:
        engine.abort(request.request_id, FinishReason.CANCELLED)  # False for finished ones
    while engine.has_unfinished():
        engine.step()


def burst_rps(engine: PagedEngine, requests: Sequence[EngineRequest]) -> float:
    """Requests per second the engine finishes when all of `requests` arrive at once."""
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    return len(requests) / max(time.perf_counter() - start, 1e-9)


def fill_decoding(
    engine: PagedEngine,
    vocab: int,
    rows: int,
    adapters: Sequence[str | None],
    max_tokens: int,
    seed: int,
    prompt: int = 32,
) -> list[EngineRequest]:
    """`rows` sequences (row i uses adapters[i % len]) added and stepped until every row is
    past its prompt and decoding: the next step is a decode step of all `rows`."""
    rng = random.Random(seed)
    requests = [
        EngineRequest(
            f"decode-{seed}-{i}",
            tuple(rng.randrange(1, vocab) for _ in range(prompt)),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            adapter=adapters[i % len(adapters)],
        )
        for i in range(rows)
    ]
    # Every adapter resident first (one one-token request each): had the rows waited on the
    # loads, the first rows would have decoded all their tokens and ended while the last
    # adapters loaded, and the timed step would hold a fraction of the rows (the H100 profile
    # of 2026-11-27 timed 64 adapters faster than the base that way).
    warm = [
        EngineRequest(
            f"decode-{seed}-warm-{i}",
            tuple(rng.randrange(1, vocab) for _ in range(prompt)),
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            adapter=adapter,
        )
        for i, adapter in enumerate(dict.fromkeys(a for a in adapters if a is not None))
    ]
    _step_until_started(engine, warm)
    for request in requests:
        engine.add_request(request)
    _step_until_started(engine, requests, add=False)
    for _ in range(5):  # past the step that admitted the last row
        outputs = engine.step()
    decoding = sum(1 for output in outputs if output.new_token_ids)
    if decoding != rows:
        raise RuntimeError(f"the filled step decodes {decoding} rows, not {rows}")
    return requests


def _step_until_started(
    engine: PagedEngine, requests: Sequence[EngineRequest], add: bool = True
) -> None:
    """Steps until each request has produced a token (added first when `add`)."""
    if add:
        for request in requests:
            engine.add_request(request)
    waiting = {request.request_id for request in requests}
    # Bounded in time, not in steps: while adapters load (on loader threads) a step with every
    # row waiting returns at once, and 10,000 of them once ran out before the 64 adapters of the
    # H200 profile had loaded.
    deadline = time.monotonic() + FILL_TIMEOUT_S
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(waiting)} rows not decoding after {FILL_TIMEOUT_S:g} s")
        outputs = engine.step()
        waiting.difference_update(o.request_id for o in outputs if o.new_token_ids)
        if not outputs:
            time.sleep(0.001)  # nothing ran: adapters still loading


def timed_steps(engine: PagedEngine, steps: int) -> float:
    """Mean seconds of `steps` engine steps, the device drained before and after."""
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    return (time.perf_counter() - start) / steps


def decode_step_s(
    engine: PagedEngine,
    vocab: int,
    rows: int,
    adapters: Sequence[str | None],
    steps: int,
    seed: int,
) -> float:
    """Seconds of one decode step of `rows` sequences (row i uses adapters[i % len]), once
    every row is past its prompt: the mean over `steps` steps."""
    requests = fill_decoding(engine, vocab, rows, adapters, steps * 2 + 128, seed)
    elapsed = timed_steps(engine, steps)
    cancel_rest(engine, requests)
    return elapsed


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# The share of requests that must meet both SLOs for a load to be within them (the knee).
KNEE_ATTAINMENT = 0.9


def slo_attainment(arm: ArmResult, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """The share of the arm's requests that finished within both SLOs."""
    return arm.goodput_rps(ttft_slo_s, tpot_slo_s) * arm.window_s / max(1, arm.requests)


def knee_rps(points: Sequence[tuple[float, float]]) -> tuple[float, bool]:
    """The arrival rate where SLO attainment falls to KNEE_ATTAINMENT, from (rate, attainment)
    points in rising rate (a ladder stopped at its first failing rung): linear between the last
    rung within and the first beyond; (rate, True) when every rung was within (a lower bound),
    0.0 when none was."""
    within = [(rate, got) for rate, got in points if got >= KNEE_ATTAINMENT]
    if not within:
        return 0.0, False
    last = within[-1]
    beyond = [(rate, got) for rate, got in points if rate > last[0] and got < KNEE_ATTAINMENT]
    if not beyond:
        return last[0], True
    (r0, a0), (r1, a1) = last, beyond[0]
    return r0 + (r1 - r0) * (a0 - KNEE_ATTAINMENT) / (a0 - a1), False


def knee_phase(
    engine: PagedEngine,
    vocab: int,
    p: dict[str, Any],
    capacity_rps: float,
    seed: int,
    adapters: Sequence[str],
    log: Progress,
) -> dict[str, Any]:
    """The knee of bench/engine/lora.py (its docstring, step 3): a ladder of loads (p's
    knee_loads x `capacity_rps`) up to the first rung past the SLOs; `adapters`: drawn with
    Zipf(1) for each request (none: the base)."""
    slo = p["slo"]
    points: list[tuple[float, float]] = []
    rungs: list[dict[str, Any]] = []
    for load in p["knee_loads"]:
        if log.elapsed() + p["knee_window_s"] + p["drain_s"] > p["deadline_s"]:
            rungs.append({"load": load, "skipped": f"past the {p['deadline_s']} s deadline"})
            break
        rate = load * capacity_rps
        times = poisson_arrivals(rate, p["knee_window_s"], seed + 5)
        tag = f"knee{load}"
        requests = make_requests(len(times), p["lengths"], vocab, seed + 6, tag)
        if adapters:
            chosen = zipf_choices(adapters, len(requests), seed + 7)
            requests = with_adapters(requests, list(chosen), tag)
        arm = drive(engine, list(zip(times, requests, strict=True)), p["knee_window_s"],
                    p["drain_s"])  # fmt: skip
        attained = slo_attainment(arm, slo["ttft_s"], slo["tpot_s"])
        points.append((rate, attained))
        summary = arm.summary(slo["ttft_s"], slo["tpot_s"])
        rungs.append({"load": load, "rate_rps": rate, "attainment": attained} | summary)
        log(f"knee, {len(adapters)} adapters, load {load}: {attained:.2f} within the SLOs")
        if attained < KNEE_ATTAINMENT:
            break
    knee, lower_bound = knee_rps(points)
    return {"knee_rps": knee, "lower_bound": lower_bound, "rungs": rungs}
