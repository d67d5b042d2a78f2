"""The prefix benchmark's workloads and its LRU bound, on hand-made traces."""

from __future__ import annotations

import math

import pytest

from bench.engine.prefix_workloads import (
    TraceTokens,
    lru_bound,
    shared_sessions,
    trace_parts,
    trace_sessions,
)
from bench.loadgen.traces import TraceRecord

A, B, C = 1, 2, 3


def row(ms: int, length: int, *ids: int) -> TraceRecord:
    return TraceRecord(ms, length, 5, ids)


def test_lru_bound_counts_leading_cached_blocks_short_of_the_last_token() -> None:
    rows = [row(0, 1024, A, B), row(10, 1024, A, B), row(20, 1536, A, B, C), row(30, 600, C, A)]
    unbounded = lru_bound(rows, 4096, math.inf, 512)
    # Second: A only (its last block holds its last token); third: A and B; fourth: C.
    assert unbounded["hit_tokens"] == 512 + 1024 + 512
    assert unbounded["offered_tokens"] == 1024 + 1024 + 1536 + 600
    # One block of room: each request's last full block evicts the others; only the fourth
    # finds its first block (C, the third's last).
    assert lru_bound(rows, 4096, 512, 512)["hit_tokens"] == 512
    # Finer blocks share the cut-off part of a block, as the engine does.
    capped = [row(0, 2000, A, B), row(1, 2000, A, B)]
    assert lru_bound(capped, 700, math.inf, 16)["hit_tokens"] == 688
    assert lru_bound(capped, 700, math.inf, 512)["hit_tokens"] == 512
    with pytest.raises(ValueError, match="divide"):
        lru_bound(rows, 4096, math.inf, 24)


def test_trace_parts_keep_order_and_rates_scale_the_trace_clock() -> None:
    rows = [row(1000 * i, 700, i, i + 1) for i in range(10)]
    parts = trace_parts(rows, 3)
    assert [len(p) for p in parts] == [4, 4, 2]
    assert [r for p in parts for r in p] == rows
    sessions, speedup = trace_sessions(
        parts[0], TraceTokens(100), rate=4.0, cap=600, max_answer=3, label="p"
    )
    assert speedup == pytest.approx(4.0)  # 1 request per trace second, replayed at 4/s
    assert [s.arrival_s for s in sessions] == pytest.approx([0, 0.25, 0.5, 0.75])
    prompt = sessions[0].turns[0].tail
    assert len(prompt) == 600
    assert prompt[:512] == TraceTokens(100).block(0)  # the same id, the same tokens
    assert sessions[1].turns[0].tail[:512] == TraceTokens(100).block(1)
    assert sessions[0].turns[0].max_tokens == 3


def test_shared_sessions_put_one_system_prompt_before_two_turns() -> None:
    questions = [((1, 2), (3,)), ((4,), (5, 6))]
    sessions = shared_sessions(
        questions, system_tokens=8, vocab=50, rate=2.0, window_s=2.0, answers=(2, 3), seed=0
    )
    assert len(sessions) == 4
    assert len({s.prefix for s in sessions}) == 1
    assert all(len(s.prefix) == 8 and len(s.turns) == 2 for s in sessions)
    assert all(s.turns[0].tail in ((1, 2), (4,)) for s in sessions)
    assert sorted(s.arrival_s for s in sessions) == [s.arrival_s for s in sessions]
