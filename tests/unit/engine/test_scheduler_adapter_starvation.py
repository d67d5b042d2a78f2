"""A request for an adapter that is not running is served while requests for the running
adapters keep arriving (issue 61's LoRA-mix case, on the bare Scheduler, no simulator). Before
site_engine/engine/core/adapter_slots.py, `_adapter_ready` skipped it while max_loras distinct
adapters ran and the later requests of a running adapter were admitted past it, so a running
adapter never drained: in fedsim's LoRA mix (32 Zipf adapters, 8 slots) the less popular
adapters' requests were never served in any routing arm. Now one running adapter drains for it
(its new requests behind it wait), never held back for a lower class, and nothing changes for
requests without an adapter."""

from __future__ import annotations

import pytest

from fedllm_contract.priority import Priority
from site_engine.engine.core.adapter_slots import adapter_to_drain
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams, SchedulerOutput


def make(max_loras: int = 1, max_num_seqs: int = 8, overtake_steps: int = 0) -> Scheduler:
    """No overtaking by default: the drain starts at once, as these tests follow it step by
    step (the default config's bound is tested on its own below)."""
    return Scheduler(
        SchedulerConfig(
            num_blocks=256,
            block_size=4,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=256,
            max_model_len=128,
            watermark=0.0,
            prefix_caching=False,
            model_name="m",
            max_loras=max_loras,
            adapter_overtake_steps=overtake_steps,
        )
    )


def tokens_for(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput({c.request_id: 1 for c in out.chunks if c.sample})


@pytest.mark.parametrize("overtake_steps", [0, 20])
def test_a_waiting_adapter_is_served_while_a_running_one_keeps_arriving(
    overtake_steps: int,
) -> None:
    scheduler = make(overtake_steps=overtake_steps)
    answer = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    scheduler.add("a-0", (1, 2, 3), answer, adapter="a")
    out = scheduler.schedule()
    scheduler.update(out, tokens_for(out))
    scheduler.add("b-0", (4, 5, 6), answer, adapter="b")
    served_at = None
    for step in range(1, 90):
        # One new request for the running adapter every step: a steady popular adapter.
        scheduler.add(f"a-{step}", (1, 2, 3), answer, adapter="a")
        out = scheduler.schedule()
        if any(c.request_id == "b-0" for c in out.chunks):
            served_at = step
            break
        scheduler.update(out, tokens_for(out))
    # Overtaken for `overtake_steps` steps (counted from the first it found the slot taken), then
    # the "a" requests running end within 5 steps and none is admitted meanwhile.
    assert served_at is not None, "b-0 never admitted in 89 steps"
    assert overtake_steps < served_at <= overtake_steps + 6


def answer(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def step(scheduler: Scheduler) -> set[str]:
    """Run one step; the ids admitted in it (their first chunk starts at 0)."""
    out = scheduler.schedule()
    scheduler.update(out, tokens_for(out))
    scheduler.check_invariants()
    return {c.request_id for c in out.chunks if c.start_position == 0}


def test_no_adapter_starves_among_several_with_two_slots() -> None:
    # Zipf-like: "a" arrives every step, "b" every other, "c" every 5th, "d" and "e" once.
    scheduler = make(max_loras=2, max_num_seqs=6)
    arrived: dict[str, int] = {}
    admitted: dict[str, int] = {}
    for now in range(120):
        if now < 80:
            names = ["a"] + ["b"] * (now % 2 == 0) + ["c"] * (now % 5 == 0)
            names += ["d"] * (now == 3) + ["e"] * (now == 4)
            for name in names:
                rid = f"{name}-{now}"
                scheduler.add(rid, (1, 2, 3), answer(), adapter=name)
                arrived[rid] = now
        admitted.update(dict.fromkeys(step(scheduler) - admitted.keys(), now))
    assert admitted.keys() == arrived.keys(), sorted(arrived.keys() - admitted.keys())
    assert not scheduler.has_unfinished()
    waits = {rid: admitted[rid] - arrived[rid] for rid in arrived}
    # A drain takes 5 steps (4 tokens and the prefill); a request waits for a few of them.
    assert max(waits.values()) <= 30, max(waits.items(), key=lambda item: item[1])


def first_admitted(scheduler: Scheduler, steps: int) -> dict[str, int]:
    """The step (from 0) at which each request admitted in the next `steps` steps was."""
    first: dict[str, int] = {}
    for now in range(steps):
        first.update(dict.fromkeys(step(scheduler) - first.keys(), now))
    return first


def test_only_the_drained_adapter_is_held_back_and_base_requests_are_not() -> None:
    scheduler = make(max_loras=2)
    scheduler.add("a-0", (1, 2, 3), answer(8), adapter="a")
    scheduler.add("b-0", (1, 2, 3), answer(2), adapter="b")
    step(scheduler)
    scheduler.add("c-0", (4, 5, 6), answer(), adapter="c")
    for name in ("a", "b", ""):
        scheduler.add(f"{name or 'base'}-1", (1, 2, 3), answer(), adapter=name)
    # "b" ends first: it drains for "c-0"; "a" and the base request go on being admitted.
    assert step(scheduler) == {"a-1", "base-1"}
    assert step(scheduler) == {"c-0"}  # "b-0" ended in the step before: its slot went to c
    assert "b-1" in first_admitted(scheduler, 12)  # once "a" or "c" drains in turn


def test_a_higher_class_request_of_a_running_adapter_is_not_held_back() -> None:
    scheduler = make(max_loras=1)
    scheduler.add("a-0", (1, 2, 3), answer(), adapter="a", priority=Priority.BATCH)
    step(scheduler)
    scheduler.add("b-0", (4, 5, 6), answer(), adapter="b", priority=Priority.FLEX)
    scheduler.add("a-flex", (1, 2, 3), answer(), adapter="a", priority=Priority.FLEX)
    scheduler.add("a-chat", (1, 2, 3), answer(), adapter="a", priority=Priority.INTERACTIVE)
    scheduler.add("a-batch", (1, 2, 3), answer(), adapter="a", priority=Priority.BATCH)
    first = first_admitted(scheduler, 16)
    # The interactive one goes at once, ahead of "b-0"; the flex one (behind "b-0" in its
    # class) and the batch one (a class below) wait while "a" drains.
    assert first["a-chat"] == 0
    assert first["a-chat"] < first["b-0"] < first["a-flex"]
    assert first["b-0"] < first["a-batch"]


def test_an_interactive_request_waiting_for_a_slot_holds_back_lower_classes() -> None:
    scheduler = make(max_loras=1)
    scheduler.add("a-0", (1, 2, 3), answer(), adapter="a")
    step(scheduler)
    scheduler.add("b-0", (4, 5, 6), answer(), adapter="b")
    scheduler.add("a-flex", (1, 2, 3), answer(), adapter="a", priority=Priority.FLEX)
    first = first_admitted(scheduler, 16)
    assert first["b-0"] < first["a-flex"]


def test_the_default_config_bounds_the_overtaking() -> None:
    default = SchedulerConfig(
        num_blocks=8, block_size=4, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16
    )
    assert 0 < default.adapter_overtake_steps < 1000
    with pytest.raises(ValueError, match="adapter_overtake_steps"):
        SchedulerConfig(
            num_blocks=8,
            block_size=4,
            max_num_seqs=1,
            max_num_batched_tokens=8,
            max_model_len=16,
            adapter_overtake_steps=-1,
        )


def trace(max_loras: int, adapters: tuple[str, ...]) -> list[tuple[tuple[str, int, int], ...]]:
    """Every step's chunks (id, start, length) for a fixed mixed-class workload."""
    scheduler = make(max_loras=max_loras, max_num_seqs=4)
    steps = []
    classes = tuple(Priority)
    for now in range(200):
        if now >= 24 and not scheduler.has_unfinished():
            break
        if now < 24:
            adapter = adapters[now % len(adapters)]
            priority = classes[now % 3]
            prompt = tuple(range(now % 7 + 2))
            scheduler.add(
                f"r{now}", prompt, answer(3 + now % 4), adapter=adapter, priority=priority
            )
        out = scheduler.schedule()
        steps.append(tuple((c.request_id, c.start_position, len(c.token_ids)) for c in out.chunks))
        scheduler.update(out, tokens_for(out))
    assert not scheduler.has_unfinished()
    return steps


def test_without_adapters_the_decisions_do_not_depend_on_the_adapter_slots() -> None:
    base = trace(max_loras=0, adapters=("",))
    assert trace(max_loras=2, adapters=("",)) == base
    # The adapters do change the schedule of the same workload once slots run short.
    assert trace(max_loras=1, adapters=("a", "b", "c")) != base


def running(rid: str, adapter: str, max_tokens: int, priority: Priority) -> Sequence:
    seq = Sequence(rid, (1, 2, 3), answer(max_tokens))
    seq.adapter, seq.priority = adapter, priority
    return seq


def test_the_adapter_drained_ends_soonest_holds_back_fewest_and_is_not_kept_by_a_higher_class() -> (
    None
):
    flex = Priority.FLEX
    seqs = [running("a", "a", 9, flex), running("b", "b", 3, flex), running("c", "c", 3, flex)]
    behind = [running("b2", "b", 3, flex)]
    assert adapter_to_drain(seqs, flex, behind) == "c"  # b and c end as soon; b holds one back
    assert adapter_to_drain(seqs, flex, []) == "b"  # a tie: the name decides
    chat = running("b-chat", "b", 1, Priority.INTERACTIVE)
    assert adapter_to_drain([*seqs, chat], flex, []) == "c"
    assert adapter_to_drain([*seqs, chat], Priority.INTERACTIVE, []) == "b"
