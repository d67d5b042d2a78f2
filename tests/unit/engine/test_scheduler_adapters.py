"""The scheduler's LoRA bookkeeping (no model): requests wait for their adapter's load, at
most max_loras distinct adapters run at once, and cached prefixes stay within one adapter."""

from __future__ import annotations

import pytest

from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams, SchedulerOutput

PROMPT = tuple(range(10, 30))  # 5 full blocks of 4


def make(max_loras: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=64,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=128,
            watermark=0.0,
            prefix_caching=True,
            model_name="m",
            max_loras=max_loras,
        )
    )


def greedy(n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def finish_all(scheduler: Scheduler) -> None:
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, tokens_for(out))


def tokens_for(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput({c.request_id: 1 for c in out.chunks if c.sample})


def scheduled_ids(out: SchedulerOutput) -> set[str]:
    return {chunk.request_id for chunk in out.chunks}


def test_a_request_waits_for_its_adapter_while_others_run() -> None:
    scheduler = make(max_loras=2)
    scheduler.add("loading", PROMPT, greedy(), adapter="a", awaiting_adapter=True)
    scheduler.add("base", PROMPT[:7], greedy())
    first = scheduler.schedule()
    assert scheduled_ids(first) == {"base"}
    assert scheduler.awaiting_adapter("a") == ["loading"]
    assert scheduler.live_adapters() == {"a"}
    scheduler.update(first, tokens_for(first))
    scheduler.adapter_loaded("a")
    second = scheduler.schedule()
    assert "loading" in scheduled_ids(second)
    assert {c.adapter for c in second.chunks} == {"a", ""}
    scheduler.check_invariants()


def test_at_most_max_loras_distinct_adapters_run_at_once() -> None:
    scheduler = make(max_loras=2)
    for name in ("a", "b", "c", "a"):
        scheduler.add(f"{name}-{len(scheduler.live_adapters())}", (1, 2, 3), greedy(), adapter=name)
    scheduler.add("base", (4, 5, 6), greedy())
    out = scheduler.schedule()
    assert {c.adapter for c in out.chunks} == {"a", "b", ""}  # "c" waits; the 2nd "a" runs
    assert len(out.chunks) == 4
    scheduler.update(out, tokens_for(out))
    finish_all(scheduler)
    scheduler.check_invariants()


def test_no_prefix_is_shared_across_adapters_but_within_one_it_is() -> None:
    scheduler = make(max_loras=4)
    scheduler.add("base", PROMPT, greedy())
    scheduler.add("a1", PROMPT, greedy(), adapter="a")
    finish_all(scheduler)
    # Each chain is cached now: one of the base's, one of adapter a's.
    scheduler.add("b1", PROMPT, greedy(), adapter="b")
    scheduler.add("a2", PROMPT, greedy(), adapter="a")
    scheduler.add("base2", PROMPT, greedy())
    out = scheduler.schedule()
    starts = {c.request_id: c.start_position for c in out.chunks}
    assert starts == {"b1": 0, "a2": 16, "base2": 16}  # 4 of 5 blocks hit; the last computes
    scheduler.update(out, tokens_for(out))
    finish_all(scheduler)
    scheduler.check_invariants()


def test_an_engine_without_adapters_refuses_one() -> None:
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        make(max_loras=0).add("r", PROMPT, greedy(), adapter="a")
