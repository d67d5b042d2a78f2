"""The deferral bound's time side: the step cost learned from the steps run (core/step_cost.py)
and the budget it gives background rows while interactive ones run (core/step_budget.py)."""

from __future__ import annotations

import math
import random

import pytest

from fedllm_contract.priority import Priority
from site_engine.engine.core.scheduler import Scheduler
from site_engine.engine.core.step_budget import StepBudget
from site_engine.engine.core.step_cost import StepCost, StepCostModel
from site_engine.engine.core.types import SchedulerOutput
from tests.unit.engine.test_scheduler import make, run_to_completion, sp, step

B = Priority.BATCH
# An 8B-on-H100-like step: 11 ms of weights, 20 us a computed token, 40 ns a KV position read.
TRUE = StepCost(0.011, 20e-6, 40e-9)


def test_learns_a_linear_step_cost_from_varied_steps() -> None:
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(200):
        tokens, context = rng.randint(1, 4096), rng.randint(1, 500_000)
        model.observe(tokens, context, TRUE.seconds(tokens, context))
    cost = model.current
    assert cost is not None
    assert cost.base_s == pytest.approx(TRUE.base_s, rel=1e-3)
    assert cost.per_token_s == pytest.approx(TRUE.per_token_s, rel=1e-3)
    assert cost.per_context_s == pytest.approx(TRUE.per_context_s, rel=1e-3)


def test_nothing_is_known_before_enough_steps_and_empty_steps_teach_nothing() -> None:
    model = StepCostModel(min_samples=10)
    for _ in range(9):
        model.observe(100, 1000, 0.02)
    model.observe(0, 0, 0.5)  # an empty step
    model.observe(100, 1000, 0.0)  # a time that cannot be
    assert model.current is None
    assert model.samples == 9
    model.observe(100, 1000, 0.02)
    assert model.current is not None


def test_alike_steps_still_predict_what_they_saw() -> None:
    """Decode-only steps: tokens (rows) and context rise together, so the coefficients are not
    identifiable one by one; the prediction for such a step still holds, and none is negative."""
    model = StepCostModel()
    rng = random.Random(1)
    for _ in range(300):
        rows = rng.randint(8, 64)
        context = rows * 1000
        model.observe(rows, context, TRUE.seconds(rows, context) * rng.uniform(0.98, 1.02))
    cost = model.current
    assert cost is not None
    assert min(cost.base_s, cost.per_token_s, cost.per_context_s) >= 0
    assert cost.seconds(32, 32_000) == pytest.approx(TRUE.seconds(32, 32_000), rel=0.03)


def test_follows_a_change_of_hardware_within_a_few_hundred_steps() -> None:
    model = StepCostModel()
    rng = random.Random(2)
    slower = StepCost(0.030, 60e-6, 0.0)
    for truth in (TRUE, slower):
        for _ in range(1000):
            tokens, context = rng.randint(1, 2048), rng.randint(1, 200_000)
            model.observe(tokens, context, truth.seconds(tokens, context))
    cost = model.current
    assert cost is not None
    assert cost.seconds(512, 100_000) == pytest.approx(slower.seconds(512, 100_000), rel=0.01)


@pytest.mark.parametrize(("decay", "min_samples"), [(0.0, 32), (1.5, 32), (0.99, 2)])
def test_bad_settings_are_refused(decay: float, min_samples: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        StepCostModel(decay=decay, min_samples=min_samples)


def test_slack_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="background_step_slack"):
        make(background_step_slack=-0.1)


# ---------------------------------------------------------------- the budget


def test_the_budget_gives_background_rows_the_slack_of_the_interactive_part() -> None:
    budget = StepBudget.for_step(8192, 512, TRUE, slack=0.1)
    assert not budget.timed  # no interactive row yet: background work is not held back
    budget.tokens -= 32  # 32 interactive decodes reading 64k positions
    budget.context += 64_000
    budget.interactive_planned(rows=32, waiting=False, max_num_seqs=256)
    assert budget.timed
    assert budget.background_s == pytest.approx(0.1 * TRUE.seconds(32, 64_000))


def test_without_a_learned_cost_or_slack_there_is_no_time_bound() -> None:
    for budget in (StepBudget.for_step(8192, 512, None, 0.1), StepBudget.for_step(8192, 512, TRUE)):
        budget.interactive_planned(rows=4, waiting=False, max_num_seqs=8)
        assert not budget.timed
        assert budget.background_s == math.inf


# ---------------------------------------------------------------- the scheduler


def teach(sched: Scheduler, cost: StepCost) -> None:
    rng = random.Random(3)
    for _ in range(64):
        tokens, context = rng.randint(1, 512), rng.randint(1, 20_000)
        sched.observe_step(tokens, context, cost.seconds(tokens, context))


def background_rows(out: SchedulerOutput) -> int:
    return sum(1 for c in out.chunks if c.request_id.startswith("b"))


# A CPU-sized step where a background row costs as much as an interactive one: 1 ms a step,
# 1 ms a token, nothing for context.
ROW_COST = StepCost(0.001, 0.001, 0.0)


def test_background_decodes_fit_the_slack_while_interactive_rows_run() -> None:
    """Two interactive decodes predict 3 ms; slack 0.5 lets background rows add 1.5 ms: one
    decode of 1 ms. Without interactive rows every background row runs."""
    sched = make(max_num_seqs=8, background_step_slack=0.5)
    teach(sched, ROW_COST)
    for n in range(4):
        sched.add(f"b{n}", [10 * n + 1, 10 * n + 2], sp(30), priority=B)
    step(sched)
    out, _ = step(sched)
    assert background_rows(out) == 4  # no interactive row: no time bound
    sched.add("i0", [100, 101], sp(30))
    sched.add("i1", [102, 103], sp(30))
    step(sched)  # the interactive prompts
    out, _ = step(sched)
    assert {c.request_id for c in out.chunks} >= {"i0", "i1"}
    assert background_rows(out) == 1
    assert out.num_tokens == 3
    assert out.context_tokens == sum(c.start_position + c.num_tokens for c in out.chunks)


def test_background_prefill_is_cut_to_fit_the_slack() -> None:
    sched = make(max_num_seqs=8, max_num_batched_tokens=64, background_step_slack=2.0)
    teach(sched, ROW_COST)
    sched.add("i", [100, 101], sp(30))
    step(sched)
    sched.add("b", list(range(1, 41)), sp(2), priority=B)
    out, _ = step(sched)
    # One interactive decode predicts 2 ms; slack 2 leaves background 4 ms: 4 prompt tokens.
    assert {c.request_id: c.num_tokens for c in out.chunks} == {"i": 1, "b": 4}


def test_a_timed_mix_loses_nothing() -> None:
    sched = make(max_num_seqs=4, max_num_batched_tokens=32, background_step_slack=0.2)
    teach(sched, ROW_COST)
    for n in range(6):
        sched.add(f"b{n}", list(range(10 * n + 1, 10 * n + 9)), sp(5), priority=B)
    for n in range(3):
        sched.add(f"i{n}", list(range(200 + 10 * n, 206 + 10 * n)), sp(7))
    _, generated = run_to_completion(sched)
    assert {rid: len(tokens) for rid, tokens in generated.items()} == {
        **{f"b{n}": 5 for n in range(6)},
        **{f"i{n}": 7 for n in range(3)},
    }
    assert sched.stats().kv_blocks_used == 0
