"""The path side of GPU mode (bench/serving_path/gpu_mode.py): open-loop arrivals through the
gateway from client processes, and the answers summarised as bench.engine.metrics summarises an
in-process run, with what refused or cut requests and each process's CPU per delivered token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from bench.engine.metrics import RequestTiming, RunSummary, summarize_run
from bench.loadgen.client import body
from bench.loadgen.workload import Request
from bench.serving_path.clients import ClientProcesses, Job, Sent
from bench.serving_path.cpu_usage import sample, spent
from bench.serving_path.figures import refusals, tokens_per_event
from bench.serving_path.http_stream import request_bytes


def open_loop(
    port: int, requests: Sequence[Request], clients: int, drain_s: float, pids: dict[str, int]
) -> tuple[list[Sent | None], dict[str, float], float]:
    """The requests sent open loop through the gateway from `clients` processes: each request's
    outcome (in request order; None: never sent), the CPU seconds each role spent over the run
    (the servers' sampled, the clients' own), and the run's start."""
    start = time.monotonic() + 1.0
    n = min(clients, len(requests))
    jobs = [
        Job(port, tuple(request_bytes(port, body(r)) for r in requests[p::n]), start, 0.0,
            drain_s, at_s=tuple(r.at_s for r in requests[p::n]))
        for p in range(n)
    ]  # fmt: skip
    processes = ClientProcesses(jobs)
    processes.start()
    roles = {name: [pid] for name, pid in pids.items()}
    time.sleep(max(0.0, start - time.monotonic()))
    before = sample(roles)
    try:
        by_process = processes.gather(max(r.at_s for r in requests) + drain_s + 60)
    finally:
        processes.kill()
    after = sample(roles)
    ordered: list[Sent | None] = [None] * len(requests)
    for p, (sent, _) in enumerate(by_process):
        for item in sent:
            ordered[p + item.index * n] = item
    cpu = {role: spent(before, after, role).cpu_s for role in roles}
    return ordered, cpu | {"clients": sum(seconds for _, seconds in by_process)}, start


def path_summary(
    requests: Sequence[Request], sent: Sequence[Sent | None], start: float, rate: float
) -> RunSummary:
    """The path's answers as bench.engine.metrics summarises an in-process run."""
    per_event = tokens_per_event([s for s in sent if s is not None])
    timings, last = [], start
    for request, item in zip(requests, sent, strict=True):
        timing = RequestTiming(request.id, request.at_s, request.answer_tokens,
                               len(request.prompt_token_ids))  # fmt: skip
        if item is not None:
            answer = item.answer
            timing.submitted_s = item.sent_s - start
            first = answer.first_s
            timing.first_token_s = first - start if first is not None else None
            tokens = answer.tokens if answer.complete else answer.events * per_event
            timing.output_tokens = round(tokens)
            if answer.complete and answer.end_s is not None:
                timing.finish_s = answer.end_s - start
            last = max(last, answer.end_s or start)
        timings.append(timing)
    cut = sum(1 for s in sent if s is None or not s.answer.complete)
    return summarize_run(
        f"path@{rate:g}", timings, arrival="poisson", poisson_rate=rate, wall_s=last - start,
        steps=0, rejected=0, truncated=cut > 0, preemptions=0, kv_block_bytes=0,
        kv_blocks_total=0, peak_kv_blocks=0, max_memory_allocated_bytes=None, mean_running=0.0,
    )  # fmt: skip


def figures(summary: RunSummary) -> dict[str, Any]:
    """What both sides report of a rate."""
    ttft, tpot = summary.ttft, summary.tpot
    return {
        "requests": summary.requests,
        "completed": summary.completed,
        "output_tokens": summary.output_tokens,
        "output_tokens_per_s": summary.output_tok_s,
        "wall_s": summary.wall_s,
        "ttft_p50_s": ttft.p50_ms / 1000 if ttft else None,
        "ttft_p99_s": ttft.p99_ms / 1000 if ttft else None,
        "tpot_p50_s": tpot.p50_ms / 1000 if tpot else None,
    }


def rate_figures(
    requests: Sequence[Request],
    sent: Sequence[Sent | None],
    cpu: dict[str, float],
    start: float,
    rate: float,
) -> dict[str, Any]:
    """One rate's figures through the path (gpu_mode's module docstring)."""
    summary = path_summary(requests, sent, start, rate)
    answered = [s for s in sent if s is not None]
    complete = [s for s in answered if s.answer.complete]
    events = sum(s.answer.events for s in complete)
    tokens = max(summary.output_tokens, 1)
    return figures(summary) | {
        "refused": sum(s.answer.status not in (0, 200) for s in answered),
        "cut": sum(
            s is None or (not s.answer.complete and s.answer.status in (0, 200)) for s in sent
        ),
        "refusals": refusals(answered),
        "tokens_per_chunk": sum(s.answer.tokens for s in complete) / events if events else None,
        "cpu_us_per_token": {role: 1e6 * seconds / tokens for role, seconds in cpu.items()},
        "cores": {role: seconds / max(summary.wall_s, 1e-9) for role, seconds in cpu.items()},
    }


def line(row: dict[str, Any]) -> str:
    """A progress line of one rate's figures."""
    return (
        f"{row['completed']}/{row['requests']} done, {row['output_tokens_per_s']:,.0f} tok/s, "
        f"TTFT p50/p99 {row['ttft_p50_s']}/{row['ttft_p99_s']} s, TPOT p50 {row['tpot_p50_s']}"
    )
