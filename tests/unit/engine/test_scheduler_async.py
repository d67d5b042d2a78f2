"""Async scheduling: step N+1 is scheduled before step N's sampled tokens reach the host."""

from __future__ import annotations

import pytest

from site_engine.engine.core.types import (
    PENDING_TOKEN,
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from tests.unit.engine.test_scheduler import EOS, make


def tokens_for(out: SchedulerOutput, value: int = 7) -> ModelRunnerOutput:
    return ModelRunnerOutput({c.request_id: value for c in out.chunks if c.sample})


def test_next_step_feeds_the_pending_token_and_update_resolves_it() -> None:
    sched = make()
    seq = sched.add("a", [1, 2, 3], SamplingParams(max_tokens=4))
    first = sched.schedule()
    second = sched.schedule()  # before the first step's token is known
    (chunk,) = second.chunks
    assert (chunk.token_ids, chunk.start_position, chunk.num_generated) == ((PENDING_TOKEN,), 3, 1)
    assert (seq.num_computed_tokens, seq.num_pending) == (4, 2)
    assert [u.new_token_ids for u in sched.update(first, tokens_for(first, 11))] == [(11,)]
    assert seq.all_token_ids == (1, 2, 3, 11, PENDING_TOKEN)
    sched.update(second, tokens_for(second, 12))
    assert (seq.output_token_ids, seq.num_pending) == ([11, 12], 0)
    sched.check_invariants()


def test_max_tokens_is_never_scheduled_past_even_with_tokens_pending() -> None:
    sched = make()
    sched.add("a", [1, 2], SamplingParams(max_tokens=2))
    steps = [sched.schedule() for _ in range(3)]
    assert [len(s.chunks) for s in steps] == [1, 1, 0]  # both tokens sampled: nothing more to run
    updates = [u for s in steps for u in sched.update(s, tokens_for(s))]
    assert [u.finish_reason for u in updates] == [None, FinishReason.LENGTH]
    assert not sched.has_unfinished()


def test_eos_discards_the_token_already_computed_in_the_next_step() -> None:
    sched = make()
    seq = sched.add("a", [1, 2], SamplingParams(max_tokens=8))
    first, second = sched.schedule(), sched.schedule()
    (update,) = sched.update(first, tokens_for(first, EOS))
    assert update.finish_reason is FinishReason.STOP
    assert sched.update(second, tokens_for(second)) == []  # the extra token is thrown away
    assert seq.output_token_ids == [EOS]
    assert sched.stats().kv_blocks_used == 0


def test_updates_must_come_once_and_in_schedule_order() -> None:
    sched = make()
    sched.add("a", [1, 2], SamplingParams(max_tokens=8))
    first, second = sched.schedule(), sched.schedule()
    with pytest.raises(ValueError, match="not the oldest"):
        sched.update(second, tokens_for(second))
    sched.update(first, tokens_for(first))
    with pytest.raises(ValueError, match="not the oldest"):
        sched.update(first, tokens_for(first))
    sched.update(second, tokens_for(second))


def test_a_request_id_reused_while_its_step_is_in_flight_never_gets_that_steps_token() -> None:
    sched = make()
    sched.add("a", [1, 2], SamplingParams(max_tokens=8))
    first = sched.schedule()
    assert sched.finish("a", FinishReason.CANCELLED)
    sched.schedule()  # "a" left before this step; only the first step can still report on it
    again = sched.add("a", [3], SamplingParams(max_tokens=1))  # the row's serial tells them apart
    assert sched.update(first, tokens_for(first)) == []  # cancelled: its token is ignored
    assert again.output_token_ids == []
    sched.check_invariants()


def test_preempted_sequence_keeps_its_pending_token_and_waits_for_it() -> None:
    # Two 3-token prompts take 4 of the 5 blocks; position 4 needs a third block each.
    sched = make(num_blocks=5, block_size=2, max_num_seqs=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    old = sched.add("old", [1, 2, 3], params, predicted_tokens=1)
    new = sched.add("new", [5, 6, 7], params, predicted_tokens=1)
    prefill = sched.schedule()
    assert {c.request_id for c in prefill.chunks} == {"old", "new"}
    decode = sched.schedule()
    sched.update(prefill, tokens_for(prefill, 8))
    grow = sched.schedule()
    assert grow.preempted_request_ids == {"new"}
    assert (new.num_computed_tokens, new.num_pending) == (0, 1)
    readmit = sched.schedule()
    assert "new" not in {c.request_id for c in readmit.chunks}  # its token is not known yet
    sched.update(decode, tokens_for(decode, 9))
    assert (new.output_token_ids, new.num_pending) == ([8, 9], 0)  # resolved while waiting
    sched.update(grow, tokens_for(grow))
    sched.update(readmit, tokens_for(readmit))
    assert old.num_output_tokens == 4
    sched.check_invariants()
