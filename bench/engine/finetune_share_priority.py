"""Part 2 of bench.engine.finetune_share_profile: what a training graph replayed on a
low-priority stream does to the serving engine's decode steps beside it, and what training it
gets done there.

The engine holds `decode_rows` requests decoding (short prompts, answers longer than the run)
and its steps run on a stream of the highest priority CUDA gives (`with torch.cuda.stream`: the
engine launches on the current stream, replays its graphs there, and waits only on its own
events). Steps are timed one `step()` call each, in blocks of `block_steps`, the arms
interleaved block by block so that the decode contexts, which grow a token a step, grow alike
under all of them:
- `alone`: nothing beside;
- `low`: the training step replayed back to back on a stream of the lowest priority;
- `same`: the same on a second stream of the engine's own priority (what priority buys).
The training stream is kept two replays deep, topped up before every step (a replay is one
launch), and drained before an `alone` block. Its throughput beside is the tokens of a replay
over the time between the ends of two replays queued back to back (CUDA events), against the
same alone, with no serving.

On the CPU there are no streams: the priority arms are not run (the result says so); the
decode steps alone and the training step alone are, so the rest of the wiring is exercised.
"""

from __future__ import annotations

import random
import time
from collections import deque
from contextlib import nullcontext
from typing import Any

import torch

from bench.engine.finetune_share_timeline import quantiles
from bench.engine.finetune_share_training import (
    Runnable,
    cuda_stream,
    median,
    priority_range,
    timing_event,
)
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import PagedEngine

ARMS = ("alone", "low", "same")


class Feeder:
    """Keeps `depth` replays of a training step queued on a stream, and the device time between
    the ends of replays queued behind another (its throughput with the stream never empty)."""

    def __init__(self, runnable: Runnable, stream: Any, depth: int = 2) -> None:
        self.runnable, self.stream, self.depth = runnable, stream, depth
        self.queued: deque[tuple[Any, bool]] = deque()
        self.last_end: Any = None
        self.periods_ms: list[float] = []

    def top_up(self) -> None:
        while self.queued and self.queued[0][0].query():
            self._retire()
        while len(self.queued) < self.depth:
            behind = bool(self.queued)
            with torch.cuda.stream(self.stream):
                self.runnable.run()
                end = timing_event()
                end.record(self.stream)
            self.queued.append((end, behind))

    def _retire(self) -> None:
        end, behind = self.queued.popleft()
        if behind and self.last_end is not None:
            self.periods_ms.append(float(self.last_end.elapsed_time(end)))
        self.last_end = end

    def drain(self) -> None:
        while self.queued:
            self.queued[0][0].synchronize()
            self._retire()
        self.last_end = None  # the next block's first replay starts a new run of periods


def _decode_requests(
    rows: int, prompt: int, answer: int, vocab: int, seed: int
) -> list[EngineRequest]:
    rng = random.Random(seed)
    greedy = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    return [
        EngineRequest(f"decode-{i}", tuple(rng.randrange(1, vocab) for _ in range(prompt)), greedy)
        for i in range(rows)
    ]


def training_alone(runnable: Runnable, device: torch.device, seconds: float) -> dict[str, Any]:
    """Replays back to back with nothing beside, on a low-priority stream where CUDA is."""
    if device.type != "cuda":
        times: list[float] = []
        began = time.perf_counter()
        while time.perf_counter() - began < seconds or len(times) < 2:
            start = time.perf_counter()
            runnable.run()
            times.append(1000 * (time.perf_counter() - start))
        period = median(times)
    else:
        low = cuda_stream(priority=max(priority_range()))
        feeder = Feeder(runnable, low)
        began = time.perf_counter()
        while time.perf_counter() - began < seconds or len(feeder.periods_ms) < 3:
            feeder.top_up()
            time.sleep(0.001)
        feeder.drain()
        period = median(feeder.periods_ms)
    return {"replay_ms_p50": period, "tokens_per_s": runnable.tokens / (period / 1000)}


def profile_priority(
    engine: PagedEngine, runnable: Runnable, vocab: int, device: torch.device, p: dict[str, Any]
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"training_mode": runnable.mode, "training_tokens": runnable.tokens}
    out["training_alone"] = training_alone(runnable, device, p["train_alone_s"])
    arms = ARMS if cuda else ("alone",)
    if cuda:
        least, greatest = priority_range()
        low_p, high_p = max(least, greatest), min(least, greatest)
        serve = cuda_stream(high_p)
        streams = {"low": cuda_stream(low_p), "same": cuda_stream(high_p)}
        out["priority_range"] = [least, greatest]
        out["stream_priorities"] = {
            "serving": serve.priority,
            **{k: s.priority for k, s in streams.items()},
        }
        torch.cuda.synchronize()
    else:
        serve, streams = None, {}
        out["streams"] = (
            "not on the CPU: no stream priorities, the low and same arms are not "
            "run; decode steps and training are timed alone"
        )
    requests = _decode_requests(
        p["decode_rows"],
        p["decode_prompt"],
        16 + p["settle_steps"] + p["block_steps"] * p["repeats"] * len(arms),
        vocab,
        seed=7,
    )
    with torch.cuda.stream(serve) if cuda else nullcontext():
        for request in requests:
            engine.add_request(request)
        _settle(engine, {r.request_id for r in requests}, p["settle_steps"])
        step_ms, periods = _blocks(engine, runnable, {a: streams.get(a) for a in arms}, p)
        for request in requests:
            engine.abort(request.request_id, FinishReason.CANCELLED)
        while engine.has_unfinished():
            engine.step()
    if cuda:
        torch.cuda.synchronize()
    out |= _arms_summary(step_ms, periods, out["training_alone"], runnable.tokens)
    return out | {k: p[k] for k in ("decode_rows", "decode_prompt", "block_steps", "repeats")}


def _settle(engine: PagedEngine, request_ids: set[str], most: int) -> None:
    """Steps until every request has its first token (every prompt prefilled, the batch all
    decoding) and four steps more, or `most` steps."""
    waiting, after = set(request_ids), 4
    for _ in range(most):
        for output in engine.step():
            if output.new_token_ids:
                waiting.discard(output.request_id)
        if not waiting:
            after -= 1
            if not after:
                return


def _blocks(
    engine: PagedEngine, runnable: Runnable, arms: dict[str, Any], p: dict[str, Any]
) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
    """Each arm's step times, block by block (the arms interleaved), and the training periods
    of the arms with a stream beside (`arms[arm]`, None for none)."""
    step_ms: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    periods: dict[str, list[float]] = {arm: [] for arm, beside in arms.items() if beside}
    for _ in range(p["repeats"]):
        for arm, beside in arms.items():
            feeder = Feeder(runnable, beside) if beside is not None else None
            times: list[float] = []
            for _ in range(p["block_steps"]):
                if feeder is not None:
                    feeder.top_up()
                began = time.perf_counter()
                engine.step()
                times.append(1000 * (time.perf_counter() - began))
            if feeder is not None:
                feeder.drain()
                periods[arm] += feeder.periods_ms
            step_ms[arm].append(times)
    return step_ms, periods


def _arms_summary(
    step_ms: dict[str, list[list[float]]],
    periods: dict[str, list[float]],
    alone_training: dict[str, Any],
    tokens: int,
) -> dict[str, Any]:
    base = quantiles([t for block in step_ms["alone"] for t in block])
    arms: dict[str, Any] = {}
    for arm, blocks in step_ms.items():
        every = [t for block in blocks for t in block]
        row: dict[str, Any] = quantiles(every)
        row["p50_per_block"] = [median(block) for block in blocks]
        row["p50_vs_alone"] = row["p50"] / base["p50"]
        row["p99_vs_alone"] = row["p99"] / base["p99"]
        row["p99_added_ms"] = row["p99"] - base["p50"]
        row["max_added_ms"] = row["max"] - base["p50"]
        if periods.get(arm):
            period = median(periods[arm])
            row["training_replay_ms_p50"] = period
            row["training_tokens_per_s"] = tokens / (period / 1000)
            row["training_vs_alone"] = alone_training["replay_ms_p50"] / period
        arms[arm] = row
    return {"decode_step_ms": arms}
