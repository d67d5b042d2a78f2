"""Idle-memory placement on the KV bookkeeping (site_engine/engine/core/kv_lending.py): the top
of a cache lent to a neighbour instance is never memory a running sequence holds, running
sequences cannot grow into it while it is lent, and it comes back whole."""

from __future__ import annotations

import random

from site_engine.engine.core.block_manager import BlockManager
from site_engine.engine.core.kv_lending import lend, lendable_bytes, take_back
from site_engine.engine.memory_plan import KvPlan

BLOCK, BYTES = 16, 1000


def plan(blocks: int, max_len: int = 64) -> KvPlan:
    return KvPlan(blocks, BLOCK, BYTES, max_len, None, 0)


def held(manager: BlockManager) -> set[int]:
    return {b for rid in manager.request_ids() for b in manager.block_table(rid)}


def lent_blocks(manager: BlockManager, total: int) -> set[int]:
    return set(range(total - manager.num_lent_blocks, total))


def test_only_the_free_top_is_lent_and_a_held_block_stops_it() -> None:
    manager = BlockManager(20, BLOCK, caching=True)
    manager.grow("a", 5 * BLOCK)  # blocks 0-4
    manager.grow("b", 3 * BLOCK)  # blocks 5-7
    # 12 free at the top: 10 blocks' worth asked, 10 lent, all above what a/b hold.
    lending = lend(manager, plan(20), 10 * BYTES)
    assert lending.blocks == 10
    assert lent_blocks(manager, 20) == set(range(10, 20))
    assert not lent_blocks(manager, 20) & held(manager)
    assert lending.plan.num_blocks == 10
    assert manager.num_free_blocks == 2
    manager.check_invariants()
    # A running sequence grows into the free blocks left, never into the lent ones.
    assert manager.try_grow("a", 7 * BLOCK)
    assert not manager.try_grow("a", 8 * BLOCK)
    assert not lent_blocks(manager, 20) & held(manager)
    manager.check_invariants()
    assert take_back(manager, lending, lending.plan).num_blocks == 20
    assert manager.try_grow("a", 8 * BLOCK)
    manager.check_invariants()


def test_a_sequence_holding_the_top_means_nothing_is_lent() -> None:
    manager = BlockManager(8, BLOCK)
    manager.grow("a", 6 * BLOCK)  # 0-5
    manager.grow("b", 2 * BLOCK)  # 6-7: the top
    manager.free("a")  # 6 free blocks, but not at the top
    lending = lend(manager, plan(8, max_len=16), 2 * BYTES)
    assert lending.blocks == 0
    assert manager.num_lent_blocks == 0
    assert manager.num_free_blocks == 6
    manager.check_invariants()


def test_the_lender_keeps_one_full_length_sequence() -> None:
    manager = BlockManager(10, BLOCK)
    assert lend(manager, plan(10, max_len=64), 7 * BYTES).blocks == 0  # would leave 3 < 4
    assert lend(manager, plan(10, max_len=64), 6 * BYTES).blocks == 6


def test_random_traffic_never_shares_a_lent_block() -> None:
    rng = random.Random(62)
    for _ in range(200):
        total = rng.randint(8, 40)
        manager = BlockManager(total, BLOCK, caching=rng.random() < 0.5)
        lengths: dict[str, int] = {}
        for step in range(rng.randint(1, 30)):
            rid = f"r{rng.randint(0, 6)}"
            if rid in lengths and rng.random() < 0.3:
                manager.free(rid)
                del lengths[rid]
                continue
            want = lengths.get(rid, 0) + rng.randint(1, 3) * BLOCK
            if manager.try_grow(rid, want):
                lengths[rid] = want
            if step % 7 == 3 and manager.num_lent_blocks == 0:
                before = held(manager)
                lending = lend(manager, plan(total, max_len=BLOCK), rng.randint(1, 6) * BYTES)
                assert held(manager) == before  # nothing a sequence holds moved or went
                assert not lent_blocks(manager, total) & held(manager)
                assert manager.num_lent_blocks == lending.blocks
            assert not lent_blocks(manager, total) & held(manager)
            manager.check_invariants()
        manager.return_lent()
        manager.check_invariants()
        assert manager.num_free_blocks + len(held(manager)) == total


def test_lendable_bytes_is_exactly_what_a_lending_can_take() -> None:
    """The room a placement is offered (lendable_bytes) lends whole, and one block more is
    refused; a held top block means no room; while lending, none."""
    manager = BlockManager(20, BLOCK)
    manager.grow("a", 3 * BLOCK)  # 0-2
    manager.grow("b", 2 * BLOCK)  # 3-4
    manager.free("a")
    # The free top 5-19: 15 blocks (the cache keeps 20 - 15 >= 4, one 64-token sequence).
    room = lendable_bytes(manager, plan(20))
    assert room == 15 * BYTES
    assert lend(manager, plan(20), room + BYTES).blocks == 0
    assert manager.num_free_blocks == 18
    lending = lend(manager, plan(20), room)
    assert lending.blocks == 15
    assert lendable_bytes(manager, lending.plan) == 0
    take_back(manager, lending, lending.plan)
    # A larger free top is capped by what the cache keeps: 20 - 4.
    manager.free("b")
    assert lendable_bytes(manager, plan(20)) == 16 * BYTES
    manager.check_invariants()
    # 18 free blocks under a held top block: no room at all.
    fresh = BlockManager(20, BLOCK)
    fresh.grow("x", 19 * BLOCK)  # 0-18
    fresh.grow("y", BLOCK)  # 19: the top
    fresh.free("x")
    assert lendable_bytes(fresh, plan(20)) == 0
    assert fresh.free_tail_blocks() == 0


def test_a_drained_top_is_lent_once_its_sequences_free_it_and_no_new_one_takes_it() -> None:
    manager = BlockManager(8, BLOCK, caching=True)
    manager.grow("a", 6 * BLOCK)  # 0-5
    manager.grow("b", 2 * BLOCK)  # 6-7: the top
    manager.free("a")
    # b holds the top: a drain waits for it and takes nothing b or a newcomer could use.
    assert lend(manager, plan(8, max_len=16), 2 * BYTES, drain=True).blocks == 0
    assert manager.draining
    assert lendable_bytes(manager, plan(8, max_len=16)) == 0  # no neighbour meanwhile
    manager.grow("c", 6 * BLOCK)  # a newcomer gets the six free blocks below the drain
    assert not set(manager.block_table("c")) & {6, 7}
    assert not manager.try_grow("c", 7 * BLOCK)  # nothing more: the drained top is not free
    manager.check_invariants()
    assert manager.drain_tail(2) == 2  # asked again meanwhile: still both held, nothing moved
    manager.free("b")  # the top's holder ends: its blocks stay out of the free queue
    assert manager.num_free_blocks == 0
    manager.check_invariants()
    lending = lend(manager, plan(8, max_len=16), 2 * BYTES, drain=True)
    assert lending.blocks == 2
    assert not manager.draining
    assert lent_blocks(manager, 8) == {6, 7}
    manager.check_invariants()
    manager.free("c")
    take_back(manager, lending, lending.plan)
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_a_drain_given_up_frees_its_blocks_again() -> None:
    manager = BlockManager(8, BLOCK)
    manager.grow("a", 6 * BLOCK)  # 0-5
    manager.grow("b", 2 * BLOCK)  # 6-7
    assert manager.drain_tail(2) == 2  # both held
    manager.free("b")  # drained, not free
    assert manager.num_free_blocks == 0
    manager.check_invariants()
    assert manager.end_drain() == 2  # the job that wanted them ended first
    assert not manager.draining
    manager.free("a")
    assert manager.num_free_blocks == 8
    assert manager.try_grow("c", 8 * BLOCK)
    manager.check_invariants()
