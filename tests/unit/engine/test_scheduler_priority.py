"""Priority classes in the scheduler (issue 52): admission by class, preemption of lower classes
for a higher one, the deferral bound on background prefill. Driven by hand-made runner outputs
(no model), through the real block manager."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fedllm_contract.priority import Priority
from site_engine.engine.core.scheduler import ClassLoad, Scheduler
from site_engine.engine.core.scheduling_policy import admission_order
from site_engine.engine.core.sequence import Sequence, SequenceStatus
from site_engine.engine.core.step_budget import StepBudget
from site_engine.engine.core.types import SamplingParams, SchedulerOutput
from tests.unit.engine.test_scheduler import (
    first_scheduled_order,
    make,
    run_to_completion,
    sp,
    step,
)

INTER, F, B = Priority.INTERACTIVE, Priority.FLEX, Priority.BATCH


def prompt(length: int, start: int = 1) -> list[int]:
    return list(range(start, start + length))


def chunk_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {c.request_id: c.num_tokens for c in out.chunks}


def class_load(sched: Scheduler, priority: Priority) -> ClassLoad:
    """The class's request counts only (test_scheduler.py checks its token counts)."""
    load = sched.stats().by_class[priority]
    return replace(load, queued_prompt_tokens=0, running_tokens=0, predicted_remaining_tokens=0)


# ---------------------------------------------------------------- admission order


def test_higher_classes_are_admitted_first_and_fcfs_within_a_class() -> None:
    sched = make(max_num_seqs=1)
    mix = (("b1", B), ("f1", F), ("i1", INTER), ("b2", B), ("i2", INTER), ("f2", F))
    for rid, priority in mix:
        sched.add(rid, prompt(3), sp(2), priority=priority)
    outputs, generated = run_to_completion(sched)
    assert first_scheduled_order(outputs) == ["i1", "i2", "f1", "f2", "b1", "b2"]
    assert all(tokens == [100, 101] for tokens in generated.values())


def test_default_class_is_interactive_and_the_spf_order_holds_within_a_class() -> None:
    sched = make(max_num_seqs=1, policy="spf", spf_aging=0.0)
    long = sched.add("long", prompt(3), sp(8), predicted_tokens=8)
    sched.add("batch-short", prompt(3), sp(1), predicted_tokens=1, priority=B)
    sched.add("short", prompt(3), sp(2), predicted_tokens=2)
    assert long.priority is INTER
    outputs, _ = run_to_completion(sched)
    assert first_scheduled_order(outputs) == ["short", "long", "batch-short"]


def test_a_preempted_sequence_is_requeued_at_the_front_of_its_class_only() -> None:
    def seq(rid: str, arrival: int, priority: Priority, preempted: bool = False) -> Sequence:
        s = Sequence(rid, (1, 2), SamplingParams(4), arrival_index=arrival, priority=priority)
        s.ever_scheduled = preempted
        return s

    waiting = [
        seq("b-early", 0, B),
        seq("b-preempted", 3, B, preempted=True),
        seq("f-new", 5, F),
        seq("i-new", 6, INTER),
        seq("i-early", 1, INTER),
    ]
    order = [s.request_id for s in admission_order(waiting, "fcfs", 1.0)]
    assert order == ["i-early", "i-new", "f-new", "b-preempted", "b-early"]


# ---------------------------------------------------------------- preemption by class


def fill_with_batch(sched: Scheduler) -> None:
    """Two batch sequences of 15-token prompts hold all 8 blocks of 4 tokens."""
    for rid in ("b1", "b2"):
        sched.add(rid, prompt(15), sp(4, ignore_eos=True), predicted_tokens=1, priority=B)
    step(sched)
    assert sched.stats().kv_blocks_used == 8


def test_interactive_preempts_the_newest_batch_sequence_when_kv_is_full() -> None:
    sched = make(num_blocks=8, max_num_batched_tokens=64)
    fill_with_batch(sched)
    i = sched.add("i", prompt(7, 50), sp(2))
    out, _ = step(sched)
    assert out.preempted_request_ids == frozenset({"b2"})
    assert chunk_tokens(out)["i"] == 7  # it joins at once, whole prompt
    b2 = sched.get("b2")
    assert b2 is not None
    assert (b2.status, b2.num_preemptions, b2.num_computed_tokens) == (SequenceStatus.WAITING, 1, 0)
    assert class_load(sched, B) == ClassLoad(B, 1, 1, 1)
    assert class_load(sched, INTER) == ClassLoad(INTER, 0, 1, 0)
    # Nothing is lost: every answer is complete, and b2's is what it would have been.
    run_to_completion(sched)
    assert b2.output_token_ids == [100, 101, 102, 103]
    assert i.output_token_ids == [100, 101]


def test_interactive_preempts_batch_for_a_batch_slot() -> None:
    sched = make(max_num_seqs=2)
    for rid in ("b1", "b2"):
        sched.add(rid, prompt(3), sp(6), priority=B)
    step(sched)
    sched.add("i", prompt(3), sp(2))
    out, _ = step(sched)
    assert out.preempted_request_ids == frozenset({"b2"})
    assert {"i", "b1"} <= set(chunk_tokens(out))


def test_flex_is_preempted_after_batch() -> None:
    sched = make(max_num_seqs=2)
    sched.add("b", prompt(3), sp(6), priority=B)
    sched.add("f", prompt(3), sp(6), priority=F)
    step(sched)
    sched.add("i1", prompt(3), sp(6))
    out, _ = step(sched)
    assert out.preempted_request_ids == frozenset({"b"})
    sched.add("i2", prompt(3), sp(6))
    out, _ = step(sched)
    assert out.preempted_request_ids == frozenset({"f"})


def test_batch_never_preempts_interactive_for_kv_it_preempts_itself() -> None:
    sched = make(num_blocks=8, max_num_batched_tokens=64)
    b = sched.add("b", prompt(16), sp(4, ignore_eos=True), predicted_tokens=1, priority=B)
    step(sched)  # 4 blocks, full: its first decode needs a fifth
    i = sched.add("i", prompt(13, 50), sp(3), predicted_tokens=1)  # the other 4 blocks
    out, _ = step(sched)
    assert out.preempted_request_ids == frozenset({"b"})
    assert chunk_tokens(out) == {"i": 13}
    run_to_completion(sched)
    assert (i.output_token_ids, b.output_token_ids) == ([100, 101, 102], [100, 101, 102, 103])


def test_interactive_growth_preempts_batch_not_itself() -> None:
    sched = make(num_blocks=8, max_num_batched_tokens=64)
    sched.add("b", prompt(13, 50), sp(8, ignore_eos=True), predicted_tokens=1, priority=B)
    step(sched)  # 4 blocks, room up to 16 tokens
    sched.add("i", prompt(16), sp(4, ignore_eos=True), predicted_tokens=1)
    out, _ = step(sched)  # the other 4 blocks
    assert chunk_tokens(out) == {"i": 16, "b": 1}
    out, _ = step(sched)  # its first decode needs a fifth
    assert out.preempted_request_ids == frozenset({"b"})
    assert chunk_tokens(out) == {"i": 1}


def test_a_waiting_interactive_request_does_not_preempt_interactive_ones() -> None:
    sched = make(num_blocks=8, max_num_batched_tokens=64)
    for rid in ("i1", "i2"):
        sched.add(rid, prompt(15), sp(2), predicted_tokens=1)
    step(sched)
    sched.add("i3", prompt(7, 50), sp(2))
    out, _ = step(sched)
    assert not out.preempted_request_ids
    assert "i3" not in chunk_tokens(out)
    outputs, _ = run_to_completion(sched)
    assert sum(len(o.preempted_request_ids) for o in outputs) == 0


def test_no_batch_sequence_is_preempted_when_that_would_not_make_room() -> None:
    """An interactive sequence holds 6 of 8 blocks, a batch one 2: a waiting interactive prompt
    that needs 4 cannot fit even without the batch sequence, which is therefore left running."""
    sched = make(num_blocks=8, max_num_batched_tokens=64, max_model_len=64)
    sched.add("b", prompt(6, 50), sp(8), predicted_tokens=1, priority=B)  # 2 blocks, 8 slots
    step(sched)
    sched.add("i1", prompt(23), sp(4), predicted_tokens=1)
    step(sched)
    assert sched.stats().kv_blocks_used == 8
    sched.add("i2", prompt(15, 80), sp(2))  # 4 blocks; the batch sequence frees only 2
    out, _ = step(sched)
    assert not out.preempted_request_ids
    assert set(chunk_tokens(out)) == {"i1", "b"}


def test_lower_class_planned_growth_does_not_hold_interactive_back() -> None:
    """The batch sequence plans for its max_tokens (no prediction), which leaves no room in the
    plan; the interactive one still enters, into blocks that are really free, preempting none."""
    sched = make(num_blocks=16, max_num_batched_tokens=64)
    sched.add("b", prompt(4), sp(56), priority=B)  # plans 60 tokens: 15 blocks
    step(sched)
    sched.add("i", prompt(8, 50), sp(4))  # plans 3 blocks
    out, _ = step(sched)
    assert not out.preempted_request_ids
    assert chunk_tokens(out) == {"i": 8, "b": 1}


# ---------------------------------------------------------------- deferral bound


def test_background_prefill_per_step_stays_within_the_deferral_bound() -> None:
    sched = make(max_num_batched_tokens=64, background_step_tokens=8)
    for n in range(3):
        sched.add(f"b{n}", prompt(20, 10 * n + 1), sp(3), priority=B if n else F)
    outputs: list[SchedulerOutput] = []
    arrived = False
    while sched.has_unfinished():
        if len(outputs) == 2 and not arrived:
            sched.add("i", prompt(40, 90), sp(3))
            arrived = True
        out, _ = step(sched)
        outputs.append(out)
        background = [c for c in out.chunks if c.request_id != "i" and c.num_tokens > 1]
        assert sum(c.num_tokens for c in background) <= 8
    # The interactive request that arrived joined the very next step with its whole prompt.
    assert chunk_tokens(outputs[2])["i"] == 40
    assert all(class_load(sched, p).num_preemptions == 0 for p in Priority)


def test_a_step_that_prefills_an_interactive_prompt_takes_no_background_prefill() -> None:
    sched = make(max_num_batched_tokens=64, background_step_tokens=16)
    sched.add("b0", prompt(4), sp(6), priority=B)
    step(sched)  # b0 decodes from now on
    sched.add("i", prompt(10, 50), sp(4))
    sched.add("b1", prompt(12, 80), sp(4), priority=B)
    out, _ = step(sched)
    assert chunk_tokens(out) == {"i": 10, "b0": 1}  # b1's prompt waits; b0's decode does not
    out, _ = step(sched)
    assert chunk_tokens(out) == {"i": 1, "b0": 1, "b1": 12}


def test_interactive_decodes_leave_background_prefill_the_squared_share_of_free_slots() -> None:
    """Bound 16, four slots: one interactive row leaves 3/4 of them, so background prefill gets
    16 * (3/4)^2 = 9 tokens; two rows 16 * (2/4)^2 = 4; none at all, the whole bound."""
    sched = make(max_num_seqs=4, max_num_batched_tokens=64, background_step_tokens=16)
    sched.add("b", prompt(60), sp(2), priority=B)
    out, _ = step(sched)
    assert chunk_tokens(out) == {"b": 16}  # no interactive row: one background iteration
    sched.add("i0", prompt(4, 100), sp(20))
    out, _ = step(sched)
    assert chunk_tokens(out) == {"i0": 4}  # an interactive prefill: no background prefill
    out, _ = step(sched)
    assert chunk_tokens(out) == {"i0": 1, "b": 9}
    sched.add("i1", prompt(4, 200), sp(20))
    step(sched)
    out, _ = step(sched)
    assert chunk_tokens(out) == {"i0": 1, "i1": 1, "b": 4}


def test_no_background_prefill_while_an_interactive_request_waits_for_room() -> None:
    budget = StepBudget.for_step(64, 16)
    budget.interactive_planned(rows=1, waiting=True, max_num_seqs=8)
    assert budget.background == 0
    busy = StepBudget.for_step(64, 16)
    busy.interactive_planned(rows=8, waiting=False, max_num_seqs=8)
    assert busy.background == 0  # every slot interactive: no capacity left
    unbounded = StepBudget.for_step(64, 0)
    unbounded.interactive_planned(rows=4, waiting=True, max_num_seqs=8)
    assert unbounded.background == 64  # no deferral bound: nothing is deferred


def test_background_decodes_are_not_deferred() -> None:
    sched = make(max_num_batched_tokens=64, background_step_tokens=2)
    for n in range(4):
        sched.add(f"b{n}", prompt(2, 10 * n + 1), sp(5), priority=B)
    outputs, generated = run_to_completion(sched)
    assert all(len(tokens) == 5 for tokens in generated.values())
    # One 2-token prompt per step under the bound, while every admitted one decodes each step.
    assert [len(o.chunks) for o in outputs[:4]] == [1, 2, 3, 4]


def test_without_a_bound_background_prefill_takes_the_whole_budget() -> None:
    sched = make(max_num_batched_tokens=64)
    sched.add("b", prompt(40), sp(2), priority=B)
    out, _ = step(sched)
    assert chunk_tokens(out) == {"b": 40}


# ---------------------------------------------------------------- starvation


def test_batch_progresses_while_interactive_load_leaves_room() -> None:
    """An interactive request every other step keeps one or two of four slots busy: the batch
    work still moves every step and all of it finishes."""
    sched = make(max_num_seqs=4, background_step_tokens=8)
    for n in range(6):
        sched.add(f"b{n}", prompt(4, 10 * n + 1), sp(6), priority=B)
    steps = 0
    batch_tokens_per_step: list[int] = []
    while sched.has_unfinished():
        if steps < 40 and steps % 2 == 0:
            sched.add(f"i{steps}", prompt(4, 200 + steps), sp(2))
        out, _ = step(sched)
        batch_tokens_per_step.append(sum(1 for c in out.chunks if c.request_id.startswith("b")))
        steps += 1
        assert steps < 500, "no progress"
    last_batch_step = max(n for n, tokens in enumerate(batch_tokens_per_step) if tokens)
    # Some batch work in every step until all of it is done, well before the interactive load
    # ends: 6 answers of 6 tokens in 4 slots, one of them (at most two) interactive. The first
    # step prefills the first interactive prompt alone: nothing of the batch runs yet.
    assert batch_tokens_per_step[0] == 0
    assert all(batch_tokens_per_step[1 : last_batch_step + 1])
    assert last_batch_step < 20
    assert sched.stats().kv_blocks_used == 0


def test_batch_runs_at_full_width_when_interactive_load_is_idle() -> None:
    sched = make(max_num_seqs=4)
    for n in range(8):
        sched.add(f"b{n}", prompt(4, 10 * n + 1), sp(4), priority=B)
    outputs, generated = run_to_completion(sched)
    assert max(len(o.chunks) for o in outputs) == 4
    assert len(outputs) == 8  # two waves of four, four steps each
    assert all(len(tokens) == 4 for tokens in generated.values())


# ---------------------------------------------------------------- random mixes


@pytest.mark.parametrize("seed", range(20))
def test_random_mixes_lose_nothing_and_never_preempt_above_a_running_class(seed: int) -> None:
    """Random classes, lengths and arrivals in a cache small enough to preempt often, with
    prefix caching in every other mix: after any step that preempted a class, no sequence of a
    lower class runs; every answer is complete (the fake tokens count generation steps, so a
    lost or repeated token shows)."""
    rng = random.Random(seed)
    sched = make(
        num_blocks=rng.randint(10, 24),
        max_num_seqs=rng.randint(2, 6),
        max_num_batched_tokens=rng.randint(8, 32),
        background_step_tokens=rng.choice([0, 4, 8]),
        policy=rng.choice(["fcfs", "spf"]),
        prefix_caching=seed % 2 == 1,
        model_name="m",
    )
    added: list[Sequence] = []
    preempted_any = False
    for n in range(60):
        if n < 30 and rng.random() < 0.6:
            added.append(
                sched.add(
                    f"r{n}",
                    # Few distinct starts: with prefix caching, classes share blocks.
                    prompt(rng.randint(1, 14), rng.choice([1, 2, 300])),
                    sp(rng.randint(1, 12), ignore_eos=True),
                    predicted_tokens=rng.choice([None, 1, 4]),
                    priority=rng.choice(list(Priority)),
                )
            )
        out, _ = step(sched)
        check_preemption_classes(sched, out)
        preempted_any = preempted_any or bool(out.preempted_request_ids)
    outputs, _ = run_to_completion(sched)
    for out in outputs:
        check_preemption_classes(sched, out)
    for seq in added:
        assert seq.output_token_ids == [100 + k for k in range(seq.sampling.max_tokens)]
    assert preempted_any or seed != 0  # the first mix at least shows preemption


def check_preemption_classes(sched: Scheduler, out: SchedulerOutput) -> None:
    if not out.preempted_request_ids:
        return
    victims = [sched.get(rid) for rid in out.preempted_request_ids]
    top_victim = min(v.priority for v in victims if v is not None)
    running = [c.request_id for c in out.chunks]
    assert all(s.priority <= top_victim for s in map(sched.get, running) if s is not None)


def test_a_preempted_sequence_takes_back_its_cached_blocks_with_prefix_caching() -> None:
    """Recompute preemption with prefix caching: the victim's full blocks stay in the cache
    (freed, not erased) unless the preemptor needs them, so it re-prefills only the rest."""
    sched = make(num_blocks=8, max_num_batched_tokens=64, prefix_caching=True, model_name="m")
    sched.add("b1", prompt(15), sp(4, ignore_eos=True), predicted_tokens=1, priority=B)
    b2 = sched.add("b2", prompt(15, 30), sp(4, ignore_eos=True), predicted_tokens=1, priority=B)
    step(sched)  # all 8 blocks held; 3 full ones of each indexed
    sched.add("i", prompt(7, 50), sp(1))  # 2 blocks: b2's partial one and one cached one
    out, _ = step(sched)
    assert out.preempted_request_ids == frozenset({"b2"})
    outputs, _ = run_to_completion(sched)
    back = next(c for o in outputs for c in o.chunks if c.request_id == "b2")
    assert back.start_position == 2 * 4  # its first two blocks were still cached
    assert b2.output_token_ids == [100, 101, 102, 103]
