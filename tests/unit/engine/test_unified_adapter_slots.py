"""Adapter slots in the KV block pool (issue 69, core/unified_slots.py), no model: slots grow
while the pool has room and shrink when sequences need it, no sequence is refused or preempted
for an adapter's memory while an idle adapter could be evicted, eviction goes by waiting demand
then recency, max_loras is a cap, and waiting requests' adapters are prefetched; the runner
writes each adapter into the slot the scheduler chose."""

from __future__ import annotations

import pytest
import torch

from fedllm_contract.priority import Priority
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams, SchedulerOutput
from site_engine.engine.lora.adapter import BaseShapes, LoraAdapter
from site_engine.engine.lora.slots import LoraSlots

BLOCK = 4
K = 8  # blocks per adapter


def make(num_blocks: int, max_loras: int = 4, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=512,
            max_model_len=256,
            watermark=0.0,
            max_loras=max_loras,
            adapter_blocks=K,
        )
    )


def greedy(n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    # Every adapter the step runs is resident (a running adapter is never evicted).
    slots = scheduler.unified_slots
    assert slots is not None
    used = {c.adapter for c in out.chunks} | {s.adapter for s in out.decode_seqs}
    assert all(slots.slot_of(name) is not None for name in used if name)
    scheduler.update(out, ModelRunnerOutput({c.request_id: 1 for c in out.chunks if c.sample}))
    scheduler.check_invariants()
    return out


def finish_all(scheduler: Scheduler) -> None:
    for _ in range(500):
        if not scheduler.has_unfinished():
            return
        step(scheduler)
    raise AssertionError("no progress")


def resident(scheduler: Scheduler) -> set[str]:
    slots = scheduler.unified_slots
    assert slots is not None
    return {name for name in "abcdefgh" if slots.slot_of(name) is not None}


def serve(scheduler: Scheduler, *adapters: str) -> None:
    """One short request of each adapter, run to the end (they stay resident, idle)."""
    for name in adapters:
        scheduler.add(f"{name}-warm", (1, 2, 3), greedy(), adapter=name)
    finish_all(scheduler)


def test_slots_grow_with_room_and_the_runner_is_told_each_slot() -> None:
    scheduler = make(num_blocks=64)
    free = scheduler.block_manager.num_free_blocks
    for name in "abc":
        scheduler.add(name, (1, 2, 3), greedy(), adapter=name)
    out = step(scheduler)
    assert out.adapter_slots is not None
    assert sorted(out.adapter_slots) == [("a", 0), ("b", 1), ("c", 2)]
    assert resident(scheduler) == {"a", "b", "c"}
    # Each resident adapter holds K blocks of the pool, beside the three sequences' one each.
    assert scheduler.block_manager.num_free_blocks == free - 3 * K - 3
    assert step(scheduler).adapter_slots is None  # unchanged since the last step
    finish_all(scheduler)
    assert resident(scheduler) == {"a", "b", "c"}  # idle, still resident while there is room


def test_idle_adapters_give_their_blocks_to_a_sequence_that_needs_them() -> None:
    scheduler = make(num_blocks=40)
    serve(scheduler, "a", "b", "c")
    assert scheduler.block_manager.num_free_blocks == 40 - 3 * K
    # 30 blocks of prompt: admitted at once (not refused), two idle adapters evicted for it.
    scheduler.add("long", tuple(range(1, 121)), greedy(1))
    out = step(scheduler)
    assert [c.request_id for c in out.chunks] == ["long"]
    assert len(resident(scheduler)) == 1
    assert scheduler.stats().num_preemptions == 0


def test_a_growing_sequence_takes_idle_adapters_blocks_before_preempting() -> None:
    scheduler = make(num_blocks=24)
    serve(scheduler, "a", "b")
    assert scheduler.block_manager.num_free_blocks == 24 - 2 * K
    scheduler.add("grows", (1, 2, 3, 4), greedy(64))  # 17 blocks: more than the 8 left free
    finish_all(scheduler)
    assert scheduler.stats().num_preemptions == 0
    assert resident(scheduler) == set()


def test_idle_adapters_are_not_evicted_for_an_admission_they_cannot_help() -> None:
    """An interactive request finds every batch slot taken by a batch-class one: a preemption
    makes its room, and evicting the idle adapters would not have, so they stay."""
    scheduler = make(num_blocks=40, max_num_seqs=1)
    serve(scheduler, "a", "b")
    scheduler.add("batch", (1, 2, 3), greedy(8), priority=Priority.BATCH)
    step(scheduler)
    scheduler.add("urgent", (1, 2, 3), greedy())
    out = step(scheduler)
    assert "urgent" in {c.request_id for c in out.chunks}
    assert scheduler.stats().num_preemptions == 1
    assert resident(scheduler) == {"a", "b"}


def test_running_adapters_are_never_evicted_the_request_waits_instead() -> None:
    scheduler = make(num_blocks=20)
    scheduler.add("a-long", (1, 2, 3), greedy(20), adapter="a")
    scheduler.add("b-long", (1, 2, 3), greedy(20), adapter="b")
    step(scheduler)
    assert resident(scheduler) == {"a", "b"}
    scheduler.add("c-1", (1, 2, 3), greedy(), adapter="c")  # 16 + 2 blocks taken: no room
    out = step(scheduler)
    assert "c-1" not in {c.request_id for c in out.chunks}
    assert resident(scheduler) == {"a", "b"}
    ran: set[str] = set()
    while scheduler.has_unfinished():  # once one drains, c's adapter takes its blocks
        out = step(scheduler)
        ran |= {c.request_id for c in out.chunks}
    assert "c-1" in ran


def test_eviction_goes_by_waiting_demand_then_least_recent() -> None:
    scheduler = make(num_blocks=40, max_num_seqs=1)
    serve(scheduler, "a", "b", "c")  # a least recent, c most
    scheduler.add("blocker", (1, 2, 3), greedy(3))
    step(scheduler)  # the only seat taken: the requests below wait
    scheduler.add("a-wait", (1, 2, 3), greedy(), adapter="a")  # a has waiting demand
    scheduler.add("d-1", (1, 2, 3), greedy(), adapter="d")
    slots = scheduler.unified_slots
    assert slots is not None
    evicted: list[str] = []
    for _ in range(2):
        before = resident(scheduler)
        assert slots.evict_one(set(), scheduler._roster.adapter_demand)
        evicted += sorted(before - resident(scheduler))
    assert evicted == ["b", "c"]  # no demand, the least recent first; "a" is waited for


def test_max_loras_caps_the_resident_adapters() -> None:
    scheduler = make(num_blocks=200, max_loras=2)
    serve(scheduler, "a", "b", "c", "d")
    assert len(resident(scheduler)) == 2
    assert resident(scheduler) <= {"c", "d"}


def test_a_waiting_requests_adapter_is_prefetched() -> None:
    scheduler = make(num_blocks=64, max_num_seqs=1)
    scheduler.add("blocker", (1, 2, 3), greedy(4))
    scheduler.add("a-wait", (1, 2, 3), greedy(), adapter="a")
    out = step(scheduler)
    assert [c.request_id for c in out.chunks] == ["blocker"]  # a-wait has no seat yet
    assert resident(scheduler) == {"a"}
    assert out.adapter_slots == (("a", 0),)
    # An adapter still loading into host memory is not prefetched.
    scheduler.add("b-wait", (1, 2, 3), greedy(), adapter="b", awaiting_adapter=True)
    step(scheduler)
    assert "b" not in resident(scheduler)


def test_idle_adapters_leave_the_top_of_the_cache_before_it_is_lent() -> None:
    scheduler = make(num_blocks=20)
    serve(scheduler, "a", "b")
    blocks = scheduler.block_manager
    assert blocks.free_tail_blocks() < 20  # an adapter holds a block of the top
    assert scheduler.evict_idle_adapters() == 2
    assert blocks.free_tail_blocks() == 20
    scheduler.check_invariants()


def test_an_unloaded_adapter_gives_its_blocks_back() -> None:
    scheduler = make(num_blocks=40)
    serve(scheduler, "a")
    scheduler.drop_adapter("a")
    assert resident(scheduler) == set()
    assert scheduler.block_manager.num_free_blocks == 40
    scheduler.check_invariants()


def test_the_runner_writes_each_adapter_into_the_slot_the_scheduler_chose() -> None:
    """LoraSlots.place (no model): adapters written where the mapping says, one evicted and
    written again into another slot holds its own weights there, and a step's adapter that the
    scheduler did not place is an error, never a silent eviction."""
    attention = dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), (4, 6))
    base = BaseShapes(1, attention | dict.fromkeys(("gate_proj", "up_proj", "down_proj"), (4, 4)))
    torch.manual_seed(0)
    adapters = {
        name: LoraAdapter.from_pairs(
            name, 2, 0.5, {(0, "q_proj"): (torch.randn(4, 2), torch.randn(2, 6))}, base, 2
        )
        for name in "abc"
    }
    slots = LoraSlots(base, 2, 2, torch.float32, torch.device("cpu"))

    def q_weights(slot: int) -> torch.Tensor:
        stacked = slots.stacked("q_proj")
        assert stacked is not None
        return stacked[0][0, slot, :, :2]

    slots.place((("a", 0), ("b", 1)), adapters.__getitem__)
    assert torch.equal(q_weights(0), adapters["a"].weights[(0, "q_proj")][0])
    assert torch.equal(q_weights(1), adapters["b"].weights[(0, "q_proj")][0])
    slots.place((("c", 0),), adapters.__getitem__)  # a and b evicted, c in a's slot
    slots.place((("c", 0), ("a", 1)), adapters.__getitem__)  # a back, in b's old slot
    assert slots.slot_of("b") is None
    assert torch.equal(q_weights(0), adapters["c"].weights[(0, "q_proj")][0])
    assert torch.equal(q_weights(1), adapters["a"].weights[(0, "q_proj")][0])
    assert slots.assign(["a", "c"], adapters.__getitem__) == {"a": 1, "c": 0}
    with pytest.raises(ValueError, match="not placed"):
        slots.assign(["b"], adapters.__getitem__)
