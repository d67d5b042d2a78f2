"""The host tier copies only blocks likely to be read again, within a per-step budget, and the
step that overwrites a block copied ahead waits for that copy (site_engine/engine/
host_offload.py, block_manager.py). Pure Python: no model, no torch."""

from __future__ import annotations

import pytest

from fedllm_contract.cache_events import BlocksStored
from site_engine.engine.core.block_manager import NO_HIT, BlockManager
from site_engine.engine.core.host_offload import OffloadLimits, OffloadPolicy
from site_engine.engine.core.scheduler import Scheduler
from site_engine.engine.core.scheduler_config import SchedulerConfig
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"blocks_per_step": 0}, "blocks_per_step"),
        ({"blocks_per_step": 1.5}, "blocks_per_step"),
        ({"active_window_steps": -1}, "active_window_steps"),
    ],
)
def test_bad_limits_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OffloadLimits(**fields)  # type: ignore[arg-type]


def test_a_block_is_wanted_if_hit_before_or_of_a_conversation_still_active() -> None:
    policy = OffloadPolicy(OffloadLimits(blocks_per_step=4, active_window_steps=3))
    assert not policy.wanted(7, hits=0)
    assert policy.wanted(7, hits=1)
    policy.left([7, 8])
    assert policy.wanted(7, hits=0)
    assert policy.wanted(8, hits=0)
    for _ in range(3):
        policy.step()
    assert policy.wanted(8, hits=0)  # left 3 steps ago: still in the window
    policy.left([8])  # its conversation's next turn left again: the window starts over
    policy.step()
    assert not policy.wanted(7, hits=0)  # 4 steps ago: forgotten
    assert policy.wanted(8, hits=0)


def test_without_a_window_only_hit_blocks_are_wanted() -> None:
    policy = OffloadPolicy(OffloadLimits(active_window_steps=0))
    policy.left([7])
    assert not policy.wanted(7, hits=0)
    assert policy.wanted(7, hits=2)


def test_the_budget_is_spent_per_step_and_counted() -> None:
    policy = OffloadPolicy(OffloadLimits(blocks_per_step=2))
    assert policy.take()
    assert policy.take()
    assert not policy.take()
    assert policy.budget_left == 0
    policy.step()
    assert policy.budget_left == 2
    policy.evicted_uncopied(5, hits=1)  # wanted, not copied: the budget's doing
    policy.evicted_uncopied(6, hits=0)  # never wanted
    assert (policy.counters.offloaded, policy.counters.skipped_budget) == (2, 1)
    assert policy.counters.declined == 1


def cached_blocks(bm: BlockManager, request_id: str, hashes: list[int]) -> None:
    """`request_id` fills len(hashes) blocks of 2 tokens, indexes them and leaves."""
    bm.grow(request_id, 2 * len(hashes))
    bm.register(request_id, hashes, len(hashes))
    bm.free(request_id)


def test_blocks_nobody_hit_of_no_active_conversation_are_evicted_uncopied() -> None:
    bm = BlockManager(3, 2, caching=True, host_slots=4, offload=OffloadLimits(8, 0))
    cached_blocks(bm, "a", [11, 12])
    bm.offload_ahead(3, step_id=1)
    assert bm.take_copies().copies == ()
    bm.grow("b", 6)  # every block: 11 and 12 are evicted without a copy
    assert bm.lookup([11]) == NO_HIT
    assert (bm.offload_counters.declined, bm.offload_counters.offloaded) == (2, 0)
    bm.check_invariants()


def test_a_block_hit_before_is_copied_ahead_and_found_in_the_host_tier() -> None:
    bm = BlockManager(3, 2, caching=True, host_slots=4, offload=OffloadLimits(8, 0))
    cached_blocks(bm, "a", [11, 12])
    hit = bm.lookup([11, 12])
    bm.admit("b", bm.lookup([11]), 3)  # 11 is hit (12 is not: it is not looked up)
    assert hit.num_blocks == 2
    bm.free("b")
    bm.offload_ahead(3, step_id=1)
    plan = bm.take_copies()
    assert [(c.to_host, c.block) for c in plan.copies] == [(True, bm.lookup([11]).device_blocks[0])]
    bm.grow("c", 6)
    found = bm.lookup([11, 12])
    assert (found.device_blocks, len(found.host_slots)) == ((), 1)
    assert bm.offload_counters.declined == 1  # 12, never hit
    bm.check_invariants()


def test_the_budget_caps_each_steps_copies_and_the_rest_is_skipped() -> None:
    bm = BlockManager(4, 2, caching=True, host_slots=8, offload=OffloadLimits(1, 100))
    cached_blocks(bm, "a", [11, 12, 13])  # a's conversation is active: all three wanted
    bm.events.take()
    bm.offload_ahead(4, step_id=1)
    first = bm.take_copies().copies
    bm.offload_ahead(4, step_id=2)
    second = bm.take_copies().copies
    # One block's worth per step, head of the free queue first: a's deepest block (2), then 1.
    assert [c.block for c in (*first, *second)] == [2, 1]
    stored = [e.block_ids for e in bm.events.take() if isinstance(e, BlocksStored)]
    assert stored == [(13,), (12,)]
    bm.grow("b", 8)  # every block: the third wanted one (11) leaves uncopied
    assert bm.offload_counters.skipped_budget == 1
    assert bm.offload_counters.offloaded == 2
    assert bm.lookup([11, 12, 13]) == NO_HIT  # the host's 12 and 13 need 11 before them
    bm.check_invariants()


def test_the_scheduler_lists_ahead_copies_and_the_step_that_overwrites_one_waits_for_it() -> None:
    config = SchedulerConfig(
        num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=8,
        max_model_len=8, prefix_caching=True, host_kv_blocks=8,
        host_offload=OffloadLimits(blocks_per_step=8, active_window_steps=50),
    )  # fmt: skip
    sched = Scheduler(config)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sched.add("a", [1, 2, 3, 4, 5], params)
    first = sched.schedule()
    sched.update(first, ModelRunnerOutput({"a": 9}))  # a finishes: its full blocks stay cached
    ahead = sched.schedule()  # nothing to run; a's blocks, wanted, are copied ahead
    assert ahead.chunks == ()
    assert ahead.kv_copies_before_step == 0
    assert sorted(c.block for c in ahead.kv_copies if c.to_host) == [0, 1]
    sched.add("b", [7, 7, 7, 7, 7, 7, 7], params)  # takes every block
    taking = sched.schedule()
    assert taking.kv_copies_wait_for_step == ahead.step_id
    assert sched.stats().host_kv_blocks_offloaded == 2


def test_copies_back_from_the_host_can_overlap_the_step_and_bind_the_next() -> None:
    bm = BlockManager(4, 2, caching=True, host_slots=4, offload=OffloadLimits(8, 100))
    cached_blocks(bm, "a", [11, 12])
    bm.offload_ahead(4, step_id=1)
    bm.take_copies(1)
    bm.grow("b", 8)  # every block: 11 and 12 now live on the host only
    bm.free("b")
    bm.take_copies(2)
    hit = bm.lookup([11, 12])
    assert len(hit.host_slots) == 2
    bm.admit("c", hit, 4, defer_onload=True)
    plan = bm.take_copies(3)
    assert [c.to_host for c in plan.copies] == [False, False]
    assert plan.before_step == 0  # step 3 does not wait for them: c computes from step 4
    assert bm.take_copies(4).wait_for_step == 3  # step 4 waits for step 3's copies


def test_a_sequence_sharing_blocks_still_loading_makes_the_step_wait_for_them() -> None:
    bm = BlockManager(6, 2, caching=True, host_slots=4, offload=OffloadLimits(8, 100))
    cached_blocks(bm, "a", [11, 12])
    bm.offload_ahead(6, step_id=1)
    bm.take_copies(1)
    bm.grow("b", 12)
    bm.free("b")
    bm.take_copies(2)
    bm.admit("c", bm.lookup([11, 12]), 4, defer_onload=True)
    sharer = bm.lookup([11, 12])
    assert len(sharer.device_blocks) == 2  # found on the device already: still loading
    bm.admit("d", sharer, 6)  # d runs in this step: it reads them
    plan = bm.take_copies(3)
    assert plan.before_step == len(plan.copies) == 2
    bm.check_invariants()


def test_the_scheduler_runs_a_host_hit_from_the_step_after_its_copies() -> None:
    config = SchedulerConfig(
        num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=8,
        max_model_len=8, prefix_caching=True, host_kv_blocks=8,
        host_offload=OffloadLimits(blocks_per_step=8, active_window_steps=50),
    )  # fmt: skip
    sched = Scheduler(config)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run_alone(request_id: str, prompt: list[int]) -> None:
        sched.add(request_id, prompt, params)
        out = sched.schedule()
        sched.update(out, ModelRunnerOutput({request_id: 9}))

    run_alone("a", [1, 2, 3, 4, 5])
    idle = sched.schedule()  # a's two full blocks are copied ahead of their eviction
    sched.update(idle, ModelRunnerOutput({}))
    run_alone("b", [7, 7, 7, 7, 7, 7, 7])  # takes every block: a's live on the host only
    sched.add("c", [1, 2, 3, 4, 6], params)
    loading = sched.schedule()
    assert loading.chunks == ()  # c is admitted, its blocks copied back during this step
    # Both of c's blocks come back (b's blocks, of a request just finished, go out after).
    assert [c.to_host for c in loading.kv_copies][:2] == [False, False]
    assert loading.kv_copies_before_step == 0
    computing = sched.schedule()
    assert [(ch.request_id, ch.start_position) for ch in computing.chunks] == [("c", 4)]
    assert computing.kv_copies_wait_for_step == loading.step_id
    assert sched.stats().prefix_cache_host_hits == 4


def test_a_block_still_loading_that_is_taken_again_makes_the_step_wait() -> None:
    bm = BlockManager(4, 2, caching=True, host_slots=4, offload=OffloadLimits(8, 100))
    cached_blocks(bm, "a", [11, 12])
    bm.offload_ahead(4, step_id=1)
    bm.take_copies(1)
    bm.grow("b", 8)
    bm.free("b")
    bm.take_copies(2)
    bm.admit("c", bm.lookup([11, 12]), 4, defer_onload=True)
    bm.free("c")  # preempted in the same step: its blocks, still loading, are free again
    bm.grow("d", 8)  # d writes every block in this step, after the copies back land
    plan = bm.take_copies(3)
    assert plan.before_step == len(plan.copies) == 2
    bm.check_invariants()
