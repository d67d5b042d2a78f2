"""The prefix cache against a straightforward reference (issue 50): a random workload runs
through the real scheduler, and every call it makes to its block manager is replayed on a plain
model of the cache: tables as lists, the free queue as a list (head first), ids in a dict, every
block id computed from scratch from the sequence's tokens, one block indexed at a time, each
change merged into the last event as it comes. Hits, evictions and events must be the same.

The manager's batched path (SequenceCache.register_all: one pass hashing and indexing the
blocks that filled in a step; evictions and frees read by place) must decide exactly what this
block-by-block model does.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import pytest

from fedllm_contract.block_hash import block_hashes, chain_hash, chains_block_hashes
from fedllm_contract.cache_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    Tier,
)
from site_engine.engine.core.block_manager import BlockManager, CacheHit
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.sequence import Sequence as Seq
from site_engine.engine.core.sequence_cache import SequenceCache
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams, SchedulerOutput


class PlainCache:
    """The reference: what the block manager's prefix cache decides, spelled out."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.size = block_size
        self.free = list(range(num_blocks))  # head first: the next block handed out
        self.refcount = [0] * num_blocks
        self.tables: dict[str, list[int]] = {}
        self.registered: dict[str, int] = {}
        self.held: dict[int, int] = {}  # id -> block
        self.id_at: dict[int, int] = {}  # block -> id
        self.events: list[CacheEvent] = []
        self.hits: list[tuple[int, ...]] = []

    def _stored(self, block_id: int, parent: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksStored) and last.block_ids[-1] == parent:
            self.events[-1] = BlocksStored((*last.block_ids, block_id), last.parent, Tier.DEVICE)
        else:
            self.events.append(BlocksStored((block_id,), parent, Tier.DEVICE))

    def _removed(self, block_id: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksRemoved):
            self.events[-1] = BlocksRemoved((*last.block_ids, block_id), Tier.DEVICE)
        else:
            self.events.append(BlocksRemoved((block_id,), Tier.DEVICE))

    def grow(self, request_id: str, num_tokens: int) -> None:
        table = self.tables.setdefault(request_id, [])
        self.registered.setdefault(request_id, 0)
        while len(table) * self.size < num_tokens:
            block = self.free.pop(0)
            self.refcount[block] += 1
            if block in self.id_at:  # evicted: handed out again
                block_id = self.id_at.pop(block)
                del self.held[block_id]
                self._removed(block_id)
            table.append(block)

    def lookup(self, hashes: Sequence[int]) -> tuple[int, ...]:
        blocks: list[int] = []
        for block_id in hashes:
            if block_id not in self.held:
                break
            blocks.append(self.held[block_id])
        self.hits.append(tuple(blocks))
        return tuple(blocks)

    def admit(self, request_id: str, blocks: Iterable[int]) -> None:
        table = self.tables[request_id] = []
        for block in blocks:
            if self.refcount[block] == 0:
                self.free.remove(block)
            self.refcount[block] += 1
            table.append(block)
        self.registered[request_id] = len(table)

    def register(self, request_id: str, ids: list[int], num_full: int) -> None:
        table = self.tables[request_id]
        for i in range(self.registered[request_id], num_full):
            block_id, block = ids[i], table[i]
            if block_id in self.held or block in self.id_at:
                continue  # a duplicate stays unindexed
            self.held[block_id], self.id_at[block] = block, block_id
            self._stored(block_id, ids[i - 1] if i else 0)
        self.registered[request_id] = max(self.registered[request_id], num_full)

    def release(self, request_id: str) -> None:
        table = self.tables.pop(request_id)
        del self.registered[request_id]
        for block in reversed(table):  # the deepest block is evicted first
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if block in self.id_at:
                    self.free.append(block)
                else:
                    self.free.insert(0, block)

    def clear(self) -> None:
        self.held.clear()
        self.id_at.clear()
        self.events = [AllBlocksCleared()]


class ReplayingManager(BlockManager):
    """The real block manager; each call the scheduler makes is replayed on the reference,
    whose ids are computed from the live sequence's tokens, not taken from the call."""

    def __init__(self, config: SchedulerConfig, live: dict[str, Seq]) -> None:
        super().__init__(config.num_blocks, config.block_size, caching=True)
        self.plain = PlainCache(config.num_blocks, config.block_size)
        self._live = live

    def grow(self, request_id: str, num_tokens_total: int) -> tuple[int, ...]:
        table = super().grow(request_id, num_tokens_total)  # raises before any change
        self.plain.grow(request_id, num_tokens_total)
        assert list(table) == self.plain.tables[request_id]
        return table

    def grow_by_one(self, request_ids: Sequence[str]) -> list[int]:
        given = super().grow_by_one(request_ids)
        size = self.block_size
        for request_id in request_ids[: len(given)]:
            held = len(self.plain.tables[request_id])
            self.plain.grow(request_id, (held + 1) * size)
            assert list(self.block_table(request_id)) == self.plain.tables[request_id]
        return given

    def lookup(self, hashes: Sequence[int]) -> CacheHit:
        hit = super().lookup(hashes)
        assert hit.device_blocks == self.plain.lookup(hashes)
        return hit

    def admit(
        self, request_id: str, hit: CacheHit, num_tokens_total: int, *, defer_onload: bool = False
    ) -> tuple[int, ...]:
        if request_id not in self.request_ids() and self.can_admit(hit, num_tokens_total):
            self.plain.admit(request_id, hit.device_blocks)  # the inner grow replays the rest
        return super().admit(request_id, hit, num_tokens_total, defer_onload=defer_onload)

    def register_all(self, registrations: Iterable[tuple[str, Sequence[int], int]]) -> None:
        registrations = list(registrations)
        super().register_all(registrations)
        size = self.block_size
        for request_id, _, num_full in registrations:
            seq = self._live[request_id]
            tokens = seq.all_token_ids[: num_full * size]
            self.plain.register(request_id, block_hashes(tokens, size, seq.root_hash), num_full)

    def free(self, request_id: str) -> int:
        released = super().free(request_id)
        self.plain.release(request_id)
        return released

    def clear_cache(self) -> None:
        super().clear_cache()
        self.plain.clear()

    def take_plain_events(self) -> list[CacheEvent]:
        events, self.plain.events = self.plain.events, []
        return events


def _scheduler(rng: random.Random) -> tuple[Scheduler, ReplayingManager]:
    size = rng.choice([2, 4])
    config = SchedulerConfig(
        num_blocks=rng.choice([24, 32, 128]) * 2 // size, block_size=size,
        max_num_seqs=rng.choice([3, 6]), max_num_batched_tokens=rng.choice([8, 24]),
        max_model_len=48, prefix_caching=True, model_name="m", watermark=0.0,
    )  # fmt: skip
    sched = Scheduler(config)
    manager = ReplayingManager(config, sched._roster.live)
    sched._roster.blocks = manager
    sched._roster.cache = SequenceCache(manager)
    return sched, manager


def _run(seed: int) -> tuple[int, int]:
    """A random workload (shared prompts, async steps two deep at times, tight caches that
    preempt and evict, a cache cleared now and then); (hits, evictions) seen."""
    rng = random.Random(seed)
    sched, manager = _scheduler(rng)
    prompts = [tuple(rng.randrange(30) for _ in range(rng.randrange(3, 30))) for _ in range(4)]
    pending: list[SchedulerOutput] = []
    tokens = random.Random(seed + 1)
    evictions = 0
    for step in range(200):
        if step < 150 and rng.random() < 0.5:
            prompt = rng.choice(prompts) + tuple(rng.randrange(30) for _ in range(rng.randrange(4)))
            sampling = SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True)
            sched.add(f"r{step}", prompt, sampling, predicted_tokens=rng.choice([None, 1]))
        if rng.random() < 0.01:
            sched.clear_prefix_cache()
        pending.append(sched.schedule())
        if len(pending) > rng.choice([1, 2]) or not pending[-1].chunks:
            done = pending.pop(0)
            sampled = {c.request_id: tokens.randrange(30) for c in done.chunks if c.sample}
            sched.update(done, ModelRunnerOutput(sampled))
        events = sched.take_cache_events()
        assert events == manager.take_plain_events()
        evictions += sum(len(e.block_ids) for e in events if isinstance(e, BlocksRemoved))
        held = {manager.cached_hash(b) for b in range(manager.num_blocks)} - {None}
        assert held == set(manager.plain.held)
        sched.check_invariants()
    hits = sum(len(hit) for hit in manager.plain.hits)
    return hits, evictions


@pytest.mark.parametrize("seed", range(16))
def test_hits_evictions_and_events_equal_the_plain_reference(seed: int) -> None:
    _run(seed)


def test_the_reference_workloads_hit_and_evict() -> None:
    """The comparison above is not vacuous: its workloads hit and evict."""
    runs = [_run(seed) for seed in range(16)]
    assert sum(hits for hits, _ in runs) > 50
    assert sum(1 for _, evictions in runs if evictions) >= 8


@pytest.mark.parametrize("seed", range(20))
def test_chains_hashed_in_one_pass_equal_each_chain_alone(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([1, 2, 16])
    tokens: list[int] = []
    chains: list[tuple[int, int]] = []
    expected: list[int] = []
    for _ in range(rng.randrange(0, 8)):
        parent, count = rng.randrange(1 << 64), rng.randrange(0, 4)
        block = [rng.randrange(1 << 32) for _ in range(count * size)]
        tokens += block
        chains.append((parent, count))
        for at in range(0, len(block), size):  # one block at a time, each from its parent
            parent = chain_hash(parent, block[at : at + size])
            expected.append(parent)
    assert chains_block_hashes(tokens, size, chains) == expected


def test_chains_refuse_tokens_that_do_not_fill_their_blocks() -> None:
    with pytest.raises(ValueError, match="more tokens"):
        chains_block_hashes([1, 2, 3], 2, [(0, 2)])
    with pytest.raises(ValueError, match="past the chains"):
        chains_block_hashes([1, 2, 3], 2, [(0, 1)])
    with pytest.raises(ValueError, match="block count"):
        chains_block_hashes([], 2, [(0, -1)])
    with pytest.raises(ValueError, match="token ids"):
        chains_block_hashes([1 << 32, 0], 2, [(0, 1)])
