"""The scheduler's accounting with prefix caching, step by step with hand-made results."""

from __future__ import annotations

from typing import Any

from site_engine.engine.core.scheduler import Scheduler
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams, SchedulerOutput
from tests.unit.engine.test_scheduler import make as make_scheduler

PROMPT = list(range(100, 116))  # four blocks of 4


def make(**overrides: Any) -> Scheduler:
    return make_scheduler(**{"prefix_caching": True, "model_name": "m", **overrides})


def run(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput({c.request_id: 7 for c in out.chunks if c.sample}))
    sched.check_invariants()
    return out


def sp(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_only_uncached_tokens_count_against_the_step_budget() -> None:
    sched = make(max_num_batched_tokens=8)
    sched.add("a", PROMPT, sp(8))
    while sched.get("a").num_computed_tokens < len(PROMPT):  # type: ignore[union-attr]
        run(sched)
    sched.add("b", [*PROMPT, 1, 2, 3, 4, 5], sp())
    out = run(sched)
    chunk_b = next(c for c in out.chunks if c.request_id == "b")
    # 16 cached tokens skipped; 5 to compute, within what a's decode token leaves of the budget.
    assert (chunk_b.start_position, chunk_b.num_tokens, chunk_b.sample) == (16, 5, True)
    assert out.num_batched_tokens == 6
    stats = sched.stats()
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (16, 16 + 21)
    assert sched.get("b").num_cached_prompt_tokens == 16  # type: ignore[union-attr]


def test_admission_plan_counts_blocks_shared_with_running_sequences_once() -> None:
    for caching, admitted in ((True, {"a", "b"}), (False, {"a"})):
        # 8 blocks. a plans 5 (16 + 4 tokens); b alone would plan 6 (17 + 4): 11 > 8. Shared,
        # b's first four blocks are a's, so b adds 2: 7 <= 8.
        sched = make(num_blocks=8, prefix_caching=caching)
        sched.add("a", PROMPT, sp(4), predicted_tokens=4)
        run(sched)
        sched.add("b", [*PROMPT, 9], sp(4), predicted_tokens=4)
        run(sched)
        assert sched.queue_lengths() == (2 - len(admitted), len(admitted)), caching


def test_a_preempted_sequence_finds_its_cached_blocks_again() -> None:
    # 7 blocks: a (16-token prompt) and b grow until one is preempted; coming back, it
    # re-prefills only what is no longer cached.
    sched = make(num_blocks=7, max_num_seqs=2)
    sched.add("a", PROMPT, sp(12), predicted_tokens=1)
    sched.add("b", [*PROMPT[:8], 1, 2, 3, 4], sp(12), predicted_tokens=1)
    preempted: set[str] = set()
    resumed_at: list[int] = []
    for _ in range(60):
        if not sched.has_unfinished():
            break
        out = run(sched)
        preempted |= out.preempted_request_ids
        resumed_at += [
            c.start_position for c in out.chunks if c.request_id in preempted and c.num_tokens > 1
        ]
    assert preempted
    assert resumed_at
    assert resumed_at[0] > 0
    assert sched.stats().kv_blocks_used == 0
