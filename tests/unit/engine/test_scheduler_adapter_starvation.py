"""A request for an adapter that is not running waits forever while requests for the running
adapters keep arriving (issue 61's LoRA-mix case, reproduced on the bare Scheduler, no
simulator): `_adapter_ready` skips it while max_loras distinct adapters run, and the requests
behind it in policy order (later arrivals of a running adapter) are admitted past it, so a
running adapter never drains. Found in fedsim's LoRA mix (32 Zipf adapters, 8 slots): the
less popular adapters' requests were never served at any rate in every routing arm.

Marked xfail(strict): it documents the defect and fails once the scheduler is fixed, so the
mark is then removed."""

from __future__ import annotations

import pytest

from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams, SchedulerOutput


def make() -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=256,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=128,
            watermark=0.0,
            prefix_caching=False,
            model_name="m",
            max_loras=1,
        )
    )


def tokens_for(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput({c.request_id: 1 for c in out.chunks if c.sample})


@pytest.mark.xfail(
    strict=True,
    reason="scheduler starvation: later requests of a running adapter overtake a waiting "
    "request of another adapter forever (issue 61, LoRA mix)",
)
def test_a_waiting_adapter_is_served_while_a_running_one_keeps_arriving() -> None:
    scheduler = make()
    answer = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    scheduler.add("a-0", (1, 2, 3), answer, adapter="a")
    out = scheduler.schedule()
    scheduler.update(out, tokens_for(out))
    scheduler.add("b-0", (4, 5, 6), answer, adapter="b")
    served_at = None
    for step in range(1, 60):
        # One new request for the running adapter every step: a steady popular adapter.
        scheduler.add(f"a-{step}", (1, 2, 3), answer, adapter="a")
        out = scheduler.schedule()
        if any(c.request_id == "b-0" for c in out.chunks):
            served_at = step
            break
        scheduler.update(out, tokens_for(out))
    # Every "a" request that arrived before "b-0" ends within 5 steps; FCFS would then hold the
    # later ones back until "b" has had its slot.
    assert served_at is not None, "b-0 never admitted in 59 steps"
    assert served_at <= 12
