"""Part 1 of bench.engine.finetune_share_profile: chat served at `load` x the engine's capacity
(Poisson arrivals of the colocated bench's chat mix), and, over a window of it, the GPU's kernel
timeline cut into steps (bench/engine/finetune_share_timeline.py): how much of each serving step
leaves the SMs idle or in memory-bound kernels.

Capacity is measured as bench.engine.finetune_colocated measures it (a burst of chat-shaped
requests all at once; priority_driver.burst). The loop then adds each request at its arrival
time and steps the engine, launching the timeline's marker before every step() call; the
profiler (CUDA activity only: the fewest host costs) runs for `profile_s` after `warm_s`. The
calls of the warm-up's second half, unprofiled, give the step time without the profiler beside
the profiled one, so its overhead shows. Arrivals stop at the window's end and what is running
is drained, unrecorded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.engine.finetune_share_timeline import (
    CARDS,
    MARKER,
    Roofline,
    StepWork,
    device_intervals,
    quantiles,
    split_steps,
    summarize,
)
from bench.engine.priority_driver import Shape, WallClock, burst, make_requests, poisson_arrivals
from fedllm_contract.priority import Priority
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.paged_engine import PagedEngine


@dataclass(slots=True)
class Call:
    """One step() call of the loop."""

    began_s: float
    wall_s: float
    prefill_tokens: int  # prompt tokens its step was scheduled (counted at scheduling)
    sampled: int  # outputs with a token that this call returned
    first: int  # of them, requests' first tokens
    in_flight: bool  # its step's results come back with the next call (async scheduling)
    wait_after: bool = False


def step_work(calls: Sequence[Call]) -> list[StepWork]:
    """The work of the step each call launched: its prefill tokens, and its sampled rows, which
    under async scheduling the next call returns. A last call whose results never came back
    has no entry."""
    out: list[StepWork] = []
    for index, call in enumerate(calls):
        if call.in_flight and index + 1 == len(calls):
            break
        source = calls[index + 1] if call.in_flight else call
        decode = source.sampled - source.first
        out.append(StepWork(call.prefill_tokens, decode, source.sampled, call.wait_after))
    return out


def roofline(model: nn.Module, device: torch.device) -> Roofline | None:
    """The card's datasheet peak and bandwidth, and the model's FLOPs per token (2 x decoder
    parameters; attention's own FLOPs left out: ~2% at these contexts) and per sampled row
    (2 x lm_head parameters). None where the card is not in CARDS (or on the CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    card = next((CARDS[key] for key in CARDS if key in name), None)
    if card is None:
        return None
    layers = getattr(getattr(model, "model", None), "layers", None)
    head = getattr(model, "lm_head", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(head, nn.Module):
        return None
    decoder = sum(p.numel() for p in layers.parameters())
    return Roofline(
        card[0], card[1], 2.0 * decoder, 2.0 * sum(p.numel() for p in head.parameters())
    )


def drive(
    engine: PagedEngine,
    arrivals: list[tuple[float, EngineRequest]],
    warm_s: float,
    profile_s: float,
    cuda: bool,
) -> tuple[list[Call], tuple[int, int], Any]:
    """Steps the engine at the arrivals' times; returns every call, the range of calls made
    while the profiler ran, and the stopped profiler."""
    pending = sorted(arrivals, key=lambda pair: pair[0])
    activity = torch.profiler.ProfilerActivity
    prof = torch.profiler.profile(activities=[activity.CUDA if cuda else activity.CPU])
    calls: list[Call] = []
    seen: set[str] = set()
    window: list[int] = []
    computed = engine.stats().prompt_tokens_computed
    start, next_arrival = time.perf_counter(), 0
    while True:
        now = time.perf_counter() - start
        if not window and now >= warm_s:
            prof.start()
            window.append(len(calls))
        if len(window) == 1 and now >= warm_s + profile_s:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
            window.append(len(calls))
            break
        while next_arrival < len(pending) and pending[next_arrival][0] <= now:
            engine.add_request(pending[next_arrival][1])
            next_arrival += 1
        if not engine.has_unfinished():
            if calls:
                calls[-1].wait_after = True
            upcoming = pending[next_arrival][0] if next_arrival < len(pending) else now + 0.001
            time.sleep(max(0.0, min(upcoming - now, 0.002)))
            continue
        if cuda:
            getattr(torch.cuda, "_sleep")(1)  # noqa: B009 (the step marker, engine's stream)
        began = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - began
        prompt_tokens = engine.stats().prompt_tokens_computed
        sampled = first = 0
        for output in outputs:
            if output.new_token_ids:
                sampled += 1
                if output.request_id not in seen:
                    seen.add(output.request_id)
                    first += 1
        calls.append(
            Call(
                began - start, wall, prompt_tokens - computed, sampled, first, engine.step_in_flight
            )
        )
        computed = prompt_tokens
    while engine.has_unfinished():  # the requests still running finish, unrecorded
        engine.step()
    return calls, (window[0], window[1]), prof


def _ms(seconds: Sequence[float]) -> dict[str, float] | None:
    return quantiles([1000 * s for s in seconds]) if seconds else None


def profile_serving(
    engine: PagedEngine,
    model: nn.Module,
    device: torch.device,
    p: dict[str, Any],
    load: float,
    seed: int,
) -> dict[str, Any]:
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 (a transformers model's)
    chat: Shape = p["interactive"]
    capacity = make_requests("cap", p["burst_requests"], chat, Priority.INTERACTIVE, vocab, seed)
    rps, _ = burst(engine, capacity, WallClock())
    warm_s, profile_s = p["warm_s"], p["profile_s"]
    times = poisson_arrivals(load * rps, warm_s + profile_s, seed + 3)
    chats = make_requests("chat", len(times), chat, Priority.INTERACTIVE, vocab, seed + 4)
    cuda = device.type == "cuda"
    calls, (first, last), prof = drive(
        engine, list(zip(times, chats, strict=True)), warm_s, profile_s, cuda
    )
    profiled = calls[first:last]
    work = step_work(profiled)
    settled = [c.wall_s for c in calls[:first] if c.began_s >= warm_s / 2]
    out: dict[str, Any] = {
        "capacity_rps": rps,
        "load": load,
        "rate_rps": load * rps,
        "requests": len(times),
        "warm_s": warm_s,
        "profile_s": profile_s,
        "calls_profiled": len(profiled),
        "steps_per_s": len(profiled) / profile_s,
        "call_ms_unprofiled": _ms(settled),
        "call_ms_profiled": _ms([c.wall_s for c in profiled]),
        "host_tokens_per_step": quantiles([w.prefill_tokens + w.decode_rows for w in work])
        if work
        else None,
        "host_decode_rows_median": sorted(w.decode_rows for w in work)[len(work) // 2]
        if work
        else None,
    }
    if not cuda:
        out["timeline"] = "none on the CPU: no device kernels to cut into steps"
        return out
    line = roofline(model, device)
    intervals = device_intervals(prof)
    rows = split_steps(intervals, work, line)
    out["markers_found"] = sum(MARKER in i.name for i in intervals)
    out["roofline"] = (
        None
        if line is None
        else {
            "peak_tflops": line.peak_flops / 1e12,
            "memory_tb_s": line.memory_bytes_per_s / 1e12,
            "ridge_tokens": line.ridge_tokens,
            "gflops_per_token": line.flops_per_token / 1e9,
        }
    )
    out["timeline"] = (
        summarize(rows)
        if rows
        else f"no step cut: {out['markers_found']} markers among {len(intervals)} device activities"
    )
    out["per_step"] = {
        key: [round(r[key], 4) for r in rows] for key in ("window_ms", "busy_fraction", "tokens")
    }
    return out
