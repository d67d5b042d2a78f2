"""The prefix cache's bookkeeping is incremental (issue 50) and changes nothing it decides: block
ids extended block by block equal the ids of the whole sequence, a scheduler that registers a
sequence only when a block of it fills decides, hits and reports exactly what one that registers
every sequence at every step does, the free queue evicts least recently freed first, and the
events built once per step from flat records equal those of the recorder that merged event by
event (kept below as the reference)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from fedllm_contract.block_hash import block_hashes, prompt_block_hashes, root_hash
from fedllm_contract.cache_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    Tier,
)
from site_engine.engine.core.block_manager import BlockManager
from site_engine.engine.core.prefix_cache import CacheEventRecorder
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams, SchedulerOutput

# --- block ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_ids_extended_block_by_block_equal_the_whole_sequences(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([1, 2, 4, 16])
    prompt = tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 80)))
    seq = Sequence("a", prompt, SamplingParams(max_tokens=500))
    seq.root_hash = root_hash("m", rng.choice(["", "salt"]))
    for _ in range(40):
        seq.output_token_ids.extend(rng.randrange(50_000) for _ in range(rng.randrange(0, 9)))
        known = seq.num_known_tokens // size
        # Sometimes one block more, sometimes several at once, sometimes none.
        seq.full_block_hashes(size, rng.randint(len(seq.block_hashes), known))
    seq.full_block_hashes(size, seq.num_known_tokens // size)
    tokens = seq.all_token_ids
    assert seq.block_hashes == block_hashes(tokens, size, seq.root_hash)
    if seq.root_hash == root_hash("m", ""):
        assert seq.block_hashes == prompt_block_hashes(tokens, size, "m")


# --- the scheduler against one that registers every sequence at every step -----------------


def _scheduler(rng: random.Random, tight: bool) -> Scheduler:
    config = SchedulerConfig(
        num_blocks=12 if tight else rng.choice([40, 96]), block_size=4,
        max_num_seqs=6 if tight else rng.choice([3, 6]), max_num_batched_tokens=rng.choice([8, 24]),
        max_model_len=48, prefix_caching=True, model_name="m", watermark=0.0,
    )  # fmt: skip
    return Scheduler(config)


def _register_always(sched: Scheduler) -> None:
    """What the scheduler did before: every running sequence registered at every update."""
    for seq in sched._roster.live.values():
        seq.next_full_block_at = 0


def _chunks(out: SchedulerOutput) -> list[tuple[Any, ...]]:
    return [
        (c.request_id, c.token_ids, c.start_position, c.block_table, c.sample) for c in out.chunks
    ]


def _drive(seed: int, reference: bool) -> list[Any]:
    """A random workload (shared prompts, async steps two deep at times); everything observed."""
    rng = random.Random(seed)
    sched = _scheduler(rng, tight=seed % 3 == 0)
    prompts = [tuple(rng.randrange(30) for _ in range(rng.randrange(3, 30))) for _ in range(4)]
    seen: list[Any] = []
    pending: list[SchedulerOutput] = []
    tokens = random.Random(seed + 1)
    for step in range(160):
        if step < 120 and rng.random() < 0.5:
            prompt = rng.choice(prompts) + tuple(rng.randrange(30) for _ in range(rng.randrange(3)))
            sampling = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)
            # A prediction too short at times: admission overcommits and preempts.
            sched.add(f"r{step}", prompt, sampling, predicted_tokens=rng.choice([None, 1]))
        out = sched.schedule()
        pending.append(out)
        seen.append(("out", _chunks(out), sorted(out.preempted_request_ids)))
        if len(pending) > rng.choice([1, 2]) or not out.chunks:
            done = pending.pop(0)
            sampled = {c.request_id: tokens.randrange(30) for c in done.chunks if c.sample}
            if reference:
                _register_always(sched)
            updates = sched.update(done, ModelRunnerOutput(sampled))
            seen.append(("updates", [(u.request_id, u.new_token_ids, u.finish_reason,
                                      u.cached_prompt_tokens) for u in updates]))  # fmt: skip
        seen.append(("events", sched.take_cache_events()))
        seen.append(("stats", sched.stats()))
        sched.check_invariants()
    return seen


@pytest.mark.parametrize("seed", range(12))
def test_registering_only_filled_blocks_changes_no_decision_hit_or_event(seed: int) -> None:
    observed = _drive(seed, reference=False)
    assert observed == _drive(seed, reference=True)
    stats = [item[1] for item in observed if item[0] == "stats"][-1]
    assert stats.prefix_cache_hits > 0, "the workload shares prompts: it must hit"


def test_the_tight_cache_workloads_preempt() -> None:
    """The comparison above covers preemption (recompute, then hits on what is still cached)."""
    last = [[item[1] for item in _drive(seed, False) if item[0] == "stats"][-1]
            for seed in (0, 3, 6, 9)]  # fmt: skip
    assert sum(stats.num_preemptions for stats in last) >= 3


# --- eviction order -------------------------------------------------------------------------


def test_freed_blocks_are_evicted_least_recently_freed_first_deepest_first() -> None:
    bm = BlockManager(9, 2, caching=True)
    for name, ids in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        bm.grow(name, 6)
        bm.register(name, ids, 3)
    bm.free("b")
    bm.free("a")
    bm.free("c")
    bm.events.take()
    bm.grow("x", 2 * 7)  # seven of the nine cached blocks go
    removed = [i for e in bm.events.take() if isinstance(e, BlocksRemoved) for i in e.block_ids]
    assert removed == [6, 5, 4, 3, 2, 1, 9]
    assert bm.lookup([7, 8]).num_blocks == 2
    bm.check_invariants()


def test_a_hit_takes_its_blocks_out_of_the_free_queue_and_refreeing_makes_them_newest() -> None:
    bm = BlockManager(4, 2, caching=True)
    bm.grow("a", 4)
    bm.register("a", [1, 2], 2)
    bm.grow("b", 4)
    bm.register("b", [3, 4], 2)
    bm.free("a")
    bm.free("b")
    bm.admit("c", bm.lookup([1, 2]), 4)  # a's chain is in use again, then freed last
    bm.free("c")
    bm.events.take()
    bm.grow("x", 4)
    assert bm.events.take() == [BlocksRemoved((4, 3), Tier.DEVICE)]


# --- events ---------------------------------------------------------------------------------


class _MergingRecorder:
    """The recorder before issue 50: each change merged into the last event as it came."""

    def __init__(self) -> None:
        self.events: list[CacheEvent] = []

    def stored(self, tier: Tier, block_hash: int, parent: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksStored) and last.tier is tier and last.block_ids[-1] == parent:
            self.events[-1] = BlocksStored((*last.block_ids, block_hash), last.parent, tier)
            return
        self.events.append(BlocksStored((block_hash,), parent, tier))

    def removed(self, tier: Tier, block_hash: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksRemoved) and last.tier is tier:
            self.events[-1] = BlocksRemoved((*last.block_ids, block_hash), tier)
            return
        self.events.append(BlocksRemoved((block_hash,), tier))

    def cleared(self) -> None:
        self.events = [AllBlocksCleared()]


@pytest.mark.parametrize("seed", range(30))
def test_events_from_flat_records_equal_the_event_by_event_merge(seed: int) -> None:
    rng = random.Random(seed)
    new, old = CacheEventRecorder(), _MergingRecorder()
    last_id = 0
    for _ in range(rng.randrange(1, 60)):
        tier = rng.choice([Tier.DEVICE, Tier.HOST])
        roll = rng.random()
        if roll < 0.6:
            parent = last_id if rng.random() < 0.6 else rng.randrange(5)
            last_id = rng.randrange(1, 1 << 64)
            for recorder in (new, old):
                recorder.stored(tier, last_id, parent)
        elif roll < 0.97:
            block = rng.randrange(1, 1 << 64)
            for recorder in (new, old):
                recorder.removed(tier, block)
        else:
            for recorder in (new, old):
                recorder.cleared()
    assert new.take() == old.events
    assert new.take() == []
