"""Drives sessions of turns through a PagedEngine on a clock, and sums up one run.

Sessions arrive open loop (their own clock, whatever the engine does); a session's next turn is
sent the moment its previous answer is complete, with everything before it as its prompt. The
wall clock is real time (the GPU preset). The step clock (presets.TokenClock with no per-token
cost) advances a fixed time per engine step and jumps over idle time: the CPU preset uses it, so
that which request is admitted when, hence what the cache holds and how many prompt tokens are
computed, does not depend on how fast this machine happens to be (its latencies are then in
virtual seconds).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.engine.metrics import percentile
from bench.engine.prefix_workloads import Session
from bench.engine.presets import Clock
from site_engine.engine.core.api import EngineRequest, EngineStats, RequestRejected
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import PagedEngine


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p99_ms: float = 2000.0
    tpot_p99_ms: float = 100.0


@dataclass(slots=True)
class _Request:
    session: Session
    turn: int
    prompt: tuple[int, ...]
    arrival_s: float
    first_s: float | None = None
    finish_s: float | None = None
    answer: list[int] = field(default_factory=list)
    cached: int = 0


def _prompt(session: Session, turn: int, answers: Sequence[Sequence[int]]) -> tuple[int, ...]:
    tokens = list(session.prefix)
    for k in range(turn):
        tokens += session.turns[k].tail
        tokens += answers[k]
    tokens += session.turns[turn].tail
    return tuple(tokens)


def drive(
    engine: PagedEngine, sessions: Sequence[Session], clock: Clock, budget_s: float, label: str
) -> dict[str, Any]:
    """Runs the sessions; requests unfinished when `budget_s` (clock seconds) ends are cut."""
    ready: list[tuple[float, int, Session, int, tuple[tuple[int, ...], ...]]] = [
        (s.arrival_s, i, s, 0, ()) for i, s in enumerate(sessions)
    ]
    heapq.heapify(ready)
    live: dict[str, _Request] = {}
    done: list[_Request] = []
    answers: dict[str, list[tuple[int, ...]]] = {s.session_id: [] for s in sessions}
    rejected = 0
    before = engine.stats()
    order = len(sessions)
    truncated = False
    while True:
        now = clock.now()
        while ready and ready[0][0] <= now:
            _, _, session, turn, kept = heapq.heappop(ready)
            request = _Request(session, turn, _prompt(session, turn, kept), now)
            request_id = f"{label}-{session.session_id}-{turn}"
            sampling = SamplingParams(
                max_tokens=session.turns[turn].max_tokens, temperature=0.0, ignore_eos=True
            )
            try:
                engine.add_request(EngineRequest(request_id, request.prompt, sampling))
            except RequestRejected:
                rejected += 1
                continue
            live[request_id] = request
        if now > budget_s:
            truncated = bool(live or ready)
            break
        if engine.has_unfinished():
            outputs = engine.step()
            clock.stepped(0)
            now = clock.now()
            for output in outputs:
                request = live[output.request_id]
                if request.first_s is None and output.new_token_ids:
                    request.first_s = now
                request.answer.extend(output.new_token_ids)
                request.cached = output.cached_prompt_tokens
                if output.finish_reason is None:
                    continue
                request.finish_s = now
                done.append(live.pop(output.request_id))
                session = request.session
                answers[session.session_id].append(tuple(request.answer))
                if request.turn + 1 < len(session.turns):
                    kept = tuple(answers[session.session_id])
                    heapq.heappush(ready, (now, order, session, request.turn + 1, kept))
                    order += 1
        elif ready:
            clock.idle_until(ready[0][0])
        else:
            break
    for request_id in live:
        engine.abort(request_id, FinishReason.CANCELLED)
    while engine.has_unfinished():
        engine.step()
    return summarize(done, list(live.values()), rejected, truncated, before, engine.stats())


def _ms(values: list[float], q: float) -> float | None:
    return percentile(values, q) * 1000 if values else None


def summarize(
    done: list[_Request],
    cut: list[_Request],
    rejected: int,
    truncated: bool,
    before: EngineStats,
    after: EngineStats,
) -> dict[str, Any]:
    ttft = [r.first_s - r.arrival_s for r in done if r.first_s is not None]
    tpot = [
        (r.finish_s - r.first_s) / (len(r.answer) - 1)
        for r in done
        if r.first_s is not None and r.finish_s is not None and len(r.answer) > 1
    ]
    everyone = done + cut
    offered = sum(len(r.prompt) for r in everyone)
    start = min((r.arrival_s for r in everyone), default=0.0)
    end = max((r.finish_s for r in done if r.finish_s is not None), default=start)
    output = sum(len(r.answer) for r in done)

    def delta(name: str) -> int:
        return int(getattr(after, name) - getattr(before, name))

    computed = delta("prompt_tokens_computed")
    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    return {
        "requests": len(everyone) + rejected,
        "completed": len(done),
        "unfinished": len(cut),
        "rejected": rejected,
        "truncated": truncated,
        "offered_prompt_tokens": offered,
        "prompt_tokens_computed": computed,
        "prefill_computed_over_offered": computed / offered if offered else None,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_host_hits": delta("prefix_cache_host_hits"),
        "hit_rate": hits / queries if queries else None,
        "host_hit_rate": delta("prefix_cache_host_hits") / queries if queries else None,
        "host_kv_bytes_offloaded": delta("host_kv_bytes_offloaded"),
        "host_kv_bytes_onloaded": delta("host_kv_bytes_onloaded"),
        "host_kv_blocks_skipped_budget": delta("host_kv_blocks_skipped_budget"),
        "host_kv_blocks_declined": delta("host_kv_blocks_declined"),
        "usage_cached_prompt_tokens": sum(r.cached for r in done),
        "preemptions": delta("num_preemptions"),
        "output_tokens": output,
        "span_s": end - start,
        "output_tok_s": output / (end - start) if end > start else None,
        "ttft_p50_ms": _ms(ttft, 50),
        "ttft_p99_ms": _ms(ttft, 99),
        "tpot_p50_ms": _ms(tpot, 50),
        "tpot_p99_ms": _ms(tpot, 99),
    }


def meets(row: dict[str, Any], slo: Slo) -> list[str]:
    """Why a run misses the SLO (empty when it holds)."""
    reasons = []
    if row["unfinished"] or row["rejected"] or row["truncated"]:
        reasons.append("requests unfinished")
    if row["ttft_p99_ms"] is None or row["ttft_p99_ms"] > slo.ttft_p99_ms:
        reasons.append("TTFT p99 over the limit")
    if row["tpot_p99_ms"] is not None and row["tpot_p99_ms"] > slo.tpot_p99_ms:
        reasons.append("TPOT p99 over the limit")
    return reasons


def goodput(rows: Sequence[dict[str, Any]]) -> float | None:
    """The highest rate that holds the SLO with every lower rate holding it too."""
    best = None
    for row in sorted(rows, key=lambda r: float(r["rate"])):
        if row["misses"]:
            break
        best = float(row["rate"])
    return best
