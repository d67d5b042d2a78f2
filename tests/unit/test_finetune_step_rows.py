"""StepRows (issue 70): the training rows a serving step carries get only the room serving
leaves, none while a request waits, and shrink at once when the measured training time of a
step outruns max_training_delay_ms (growing back at most 2x a step under it)."""

from __future__ import annotations

import pytest

from site_engine.engine.core.api import EngineStats
from site_engine.finetune.step_rows import StepRows
from site_engine.finetune.step_work import NextStep, rows_gate
from site_engine.idle_work import IdleGate


def test_rows_get_only_the_room_serving_leaves() -> None:
    rows = StepRows(max_training_delay_ms=10.0, min_rows=16)
    rows.rows = 1000
    assert rows.for_step(serving_tokens=200, token_budget=512, waiting=0) == 312
    assert rows.for_step(serving_tokens=500, token_budget=512, waiting=0) == 0  # 12 < min_rows
    assert rows.for_step(serving_tokens=10, token_budget=2048, waiting=0) == 1000


def test_no_rows_while_a_request_waits() -> None:
    rows = StepRows(max_training_delay_ms=10.0)
    rows.rows = 256
    assert rows.for_step(serving_tokens=0, token_budget=4096, waiting=1) == 0
    assert rows.skipped_waiting == 1


def test_rows_shrink_when_the_delay_outruns_the_bound_and_grow_back_slowly() -> None:
    rows = StepRows(max_training_delay_ms=10.0, min_rows=16, max_rows=4096)
    assert rows.rows == 16  # the first step measures
    rows.observe(16, 0.001)  # 1 ms for 16 rows: 8 ms fits 128, but growth caps at 2x
    assert rows.rows == 32
    rows.observe(32, 0.002)
    assert rows.rows == 64
    rows.rows = 512
    rows.observe(512, 0.040)  # 40 ms against 10: 4x over
    assert rows.over_bound == 1
    assert rows.rows == int(512 * 0.8 * 10 / 40)  # 102: sized to 80% of the bound
    assert rows.max_delay_ms == pytest.approx(40.0)
    rows.observe(102, 0.012)  # still over: shrinks again, never grows
    assert rows.rows < 102
    assert rows.over_bound == 2
    small = rows.rows
    rows.observe(small, 0.001)
    assert small < rows.rows <= 2 * small
    assert rows.steps_with_rows == 5


def test_rows_never_drop_below_the_minimum_nor_pass_the_maximum() -> None:
    rows = StepRows(max_training_delay_ms=10.0, min_rows=16, max_rows=64)
    rows.observe(16, 1.0)
    assert rows.rows == 16
    for _ in range(10):
        rows.observe(rows.rows, 0.0001)
    assert rows.rows == 64


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="bound > 0"):
        StepRows(max_training_delay_ms=0.0)
    with pytest.raises(ValueError, match="min_rows"):
        StepRows(max_training_delay_ms=5.0, min_rows=0)
    with pytest.raises(ValueError, match="cannot be observed"):
        StepRows(max_training_delay_ms=5.0).observe(0, 0.1)


def _stats(
    waiting: int, running: int, queued: int = 0, used: int = 0, total: int = 100
) -> EngineStats:
    return EngineStats(num_waiting=waiting, num_running=running, queued_prompt_tokens=queued,
                       running_tokens=0, predicted_remaining_tokens=0, kv_blocks_used=used,
                       kv_blocks_total=total, iterations=0)  # fmt: skip


def test_a_request_the_next_step_admits_does_not_stop_the_rows() -> None:
    """Issue 76: every arrival cost the job a piece (28 % of the steps at 0.6x load on an
    H200). A request that waits only for the next step's boundary is delayed one bounded piece,
    as a running one is; one that waits for room (a sequence, the step's tokens, KV blocks)
    stops the rows, and the gate, as before."""
    step = NextStep(token_budget=512, max_num_seqs=8, block_size=16)
    assert step.admits_waiting(_stats(waiting=0, running=8))
    assert step.admits_waiting(_stats(waiting=2, running=6, queued=300))
    assert not step.admits_waiting(_stats(waiting=2, running=7, queued=300))  # sequences
    assert not step.admits_waiting(_stats(waiting=1, running=6, queued=507))  # 6 + 507 tokens
    assert not step.admits_waiting(_stats(waiting=1, running=6, queued=100, used=95))  # blocks
    gate = rows_gate(10.0, step)
    assert gate.allows(_stats(waiting=2, running=6, queued=300), 0.005)
    assert not gate.allows(_stats(waiting=2, running=7, queued=300), 0.005)
    assert not IdleGate(0.01).allows(_stats(waiting=2, running=6, queued=300), 0.005)
    with pytest.raises(ValueError, match="NextStep needs"):
        NextStep(token_budget=0, max_num_seqs=8, block_size=16)
