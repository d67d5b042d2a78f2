"""The prefix cache's bookkeeping by hand: eviction order, the events it records, snapshots,
and the site's journal and per-stream batching of those events."""

from __future__ import annotations

import asyncio

from fedllm_contract.cache_events import (
    CHAIN_START,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    Tier,
)
from site_engine.cache_event_journal import CacheEventJournal, CacheEventStream, Snapshot
from site_engine.engine.core.block_manager import BlockManager, CopyPlan

DEVICE, HOST = Tier.DEVICE, Tier.HOST


def cached(num_blocks: int = 6, host_slots: int = 0) -> BlockManager:
    return BlockManager(num_blocks, 2, caching=True, host_slots=host_slots)


def runs(events: list[CacheEvent]) -> set[tuple[int, tuple[int, ...]]]:
    """(parent, ids) of each event, every one of which must be a BlocksStored."""
    found = set()
    for event in events:
        assert isinstance(event, BlocksStored)
        found.add((event.parent, event.block_ids))
    return found


def test_a_registered_chain_is_one_stored_event_and_eviction_removes_lru_first() -> None:
    bm = cached()
    bm.grow("a", 6)
    bm.register("a", [11, 12, 13], 3)
    assert bm.events.take() == [BlocksStored((11, 12, 13), CHAIN_START, DEVICE)]
    table_a = bm.block_table("a")
    bm.free("a")
    bm.grow("b", 6)  # 3 blocks were never used: b takes those, nothing is evicted
    assert bm.events.take() == []
    assert not set(bm.block_table("b")) & set(table_a)
    bm.grow("c", 2)  # the next block comes from a's: its deepest block goes first
    assert bm.block_table("c") == (table_a[2],)
    assert bm.events.take() == [BlocksRemoved((13,), DEVICE)]
    assert bm.lookup([11, 12, 13]).device_blocks == table_a[:2]
    bm.check_invariants()


def test_unindexed_freed_blocks_are_reused_before_cached_ones() -> None:
    bm = cached(num_blocks=4)
    bm.grow("a", 4)
    bm.register("a", [21, 22], 2)
    bm.grow("x", 4)  # two blocks holding no id
    bm.free("a")
    bm.free("x")
    bm.grow("y", 4)
    assert bm.num_cached_blocks == 2  # y took x's blocks, a's chain is intact
    assert len(bm.lookup([21, 22]).device_blocks) == 2


def test_snapshot_lists_every_chain_with_its_parent_including_branches() -> None:
    bm = cached(num_blocks=8)
    bm.grow("a", 6)
    bm.register("a", [1, 2, 3], 3)
    hit = bm.lookup([1, 2, 9])
    bm.admit("b", hit, 6)
    bm.register("b", [1, 2, 9], 3)  # a second child of block 2
    bm.grow("c", 2)
    bm.register("c", [7], 1)
    assert runs(bm.snapshot_events()) in (
        {(0, (1, 2, 3)), (2, (9,)), (0, (7,))},
        {(0, (1, 2, 9)), (2, (3,)), (0, (7,))},
    )
    bm.clear_cache()
    assert bm.events.take()[-1:] == [AllBlocksCleared()]
    assert bm.snapshot_events() == []
    assert bm.lookup([1]).num_blocks == 0


def test_host_tier_events_and_copies() -> None:
    bm = cached(num_blocks=2, host_slots=1)
    bm.grow("a", 2)
    bm.register("a", [5], 1)
    bm.free("a")  # a's conversation is active: its block is worth a copy
    bm.events.take()
    bm.offload_ahead(2, step_id=1)  # 5 is next to be evicted: copied ahead
    plan = bm.take_copies()
    assert [(c.to_host, c.block, c.slot) for c in plan.copies] == [(True, 0, 0)]
    assert (plan.before_step, plan.wait_for_step) == (0, 0)  # ahead of eviction: nobody waits
    assert bm.events.take() == [BlocksStored((5,), CHAIN_START, HOST)]
    bm.grow("b", 4)  # both blocks: the step that overwrites 5's waits for step 1's copy
    assert bm.take_copies() == CopyPlan((), 0, 1)
    assert bm.events.take() == [BlocksRemoved((5,), DEVICE)]
    hit = bm.lookup([5])
    assert (hit.device_blocks, hit.host_slots) == ((), (0,))
    bm.free("b")
    bm.grow("c", 2)
    bm.register("c", [6], 1)
    bm.free("c")
    bm.offload_ahead(2, step_id=3)  # 6 is next to be evicted: copied ahead, 5 leaves the slot
    assert bm.events.take()[-2:] == [
        BlocksRemoved((5,), HOST),
        BlocksStored((6,), CHAIN_START, HOST),
    ]
    assert bm.take_copies().before_step == 0
    bm.check_invariants()


def test_journal_reads_from_a_position_and_refuses_lost_or_cleared_ones() -> None:
    journal = CacheEventJournal(block_size=16, max_ids=4)
    epoch = journal.epoch
    journal.append([BlocksStored((1, 2), CHAIN_START, DEVICE)])
    assert journal.read(0, epoch) == ([BlocksStored((1, 2), CHAIN_START, DEVICE)], 1)
    journal.append([BlocksStored((3, 4, 5), 2, DEVICE)])  # 5 ids: the first event goes
    assert journal.read(0, epoch) is None
    assert journal.read(1, epoch) == ([BlocksStored((3, 4, 5), 2, DEVICE)], 2)
    journal.append([AllBlocksCleared()])
    assert journal.epoch != epoch
    assert journal.read(2, epoch) is None
    assert journal.read(2, journal.epoch) == ([], 2)


def test_stream_starts_with_a_snapshot_splits_long_runs_and_resnapshots() -> None:
    journal = CacheEventJournal(block_size=16, max_ids=6)
    held = [BlocksStored((1, 2, 3, 4, 5), CHAIN_START, DEVICE)]
    snapshots = 0

    async def snapshot() -> Snapshot:
        nonlocal snapshots
        snapshots += 1
        return Snapshot(list(held), journal.position, journal.epoch)

    async def run() -> None:
        stream = CacheEventStream(journal, snapshot, max_ids=3)
        first = await stream.next_batch()
        assert (first.snapshot, first.sequence) == (True, 1)
        assert first.events == (BlocksStored((1, 2, 3), CHAIN_START, DEVICE),)
        journal.append([BlocksRemoved((1,), DEVICE)])
        rest = await stream.next_batch()  # the snapshot's rest, chained from 3, before news
        assert (rest.snapshot, rest.sequence) == (False, 2)
        assert rest.events == (BlocksStored((4, 5), 3, DEVICE),)
        news = await stream.next_batch()
        assert news.events == (BlocksRemoved((1,), DEVICE),)
        assert (await stream.next_batch()).events == ()
        journal.append([BlocksStored(tuple(range(10, 17)), CHAIN_START, DEVICE)])  # > 6 ids kept
        journal.append([BlocksStored((20,), CHAIN_START, DEVICE)])
        behind = await stream.next_batch()
        assert behind.snapshot  # fell behind the journal: starts over
        assert snapshots == 2
        assert [b.epoch for b in (first, behind)] == [journal.epoch] * 2

    asyncio.run(run())


def test_stream_splits_a_long_removal_across_batches() -> None:
    journal = CacheEventJournal(block_size=16, max_ids=16)

    async def snapshot() -> Snapshot:
        return Snapshot([], journal.position, journal.epoch)

    async def run() -> None:
        stream = CacheEventStream(journal, snapshot, max_ids=2)
        assert (await stream.next_batch()).events == ()
        journal.append([BlocksRemoved((1, 2, 3), HOST)])
        assert (await stream.next_batch()).events == (BlocksRemoved((1, 2), HOST),)
        assert (await stream.next_batch()).events == (BlocksRemoved((3,), HOST),)

    asyncio.run(run())
