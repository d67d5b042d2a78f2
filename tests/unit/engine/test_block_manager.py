"""BlockManager: growth by real tokens, refcounts, loud double frees, non-contiguous tables."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import pytest

from site_engine.engine.core.block_manager import BlockManager, OutOfBlocks


def snapshot(bm: BlockManager) -> tuple[object, ...]:
    tables = {rid: bm.block_table(rid) for rid in bm.request_ids()}
    return (bm.num_free_blocks, bm.num_used_blocks, tables)


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (7, 1, 7), (3, 16, 1)],
)
def test_blocks_needed_is_ceil_division(num_tokens: int, block_size: int, expected: int) -> None:
    assert BlockManager(8, block_size).blocks_needed(num_tokens) == expected


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size)


def test_grow_allocates_only_missing_blocks_and_never_shrinks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    steps = [(0, 0), (1, 1), (4, 1), (5, 2), (12, 3), (3, 3), (13, 4)]
    for num_tokens, expected_blocks in steps:
        table = bm.grow("a", num_tokens)
        bm.check_invariants()
        assert len(table) == expected_blocks
        assert bm.block_table("a") == table
        assert bm.num_used_blocks == expected_blocks
        assert bm.num_free_blocks == 8 - expected_blocks
    assert len(set(bm.block_table("a"))) == 4


def test_grow_zero_creates_an_empty_table() -> None:
    bm = BlockManager(2, 4)
    assert bm.grow("a", 0) == ()
    assert bm.has_table("a")
    assert bm.free("a") == 0
    bm.check_invariants()


def test_out_of_blocks_leaves_state_unchanged() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.grow("a", 4)
    bm.grow("b", 1)
    before = snapshot(bm)
    assert not bm.can_grow("b", 6)
    with pytest.raises(OutOfBlocks) as info:
        bm.grow("b", 6)  # needs 2 more, 1 free
    assert (info.value.request_id, info.value.needed, info.value.free) == ("b", 2, 1)
    assert snapshot(bm) == before
    with pytest.raises(OutOfBlocks):
        bm.grow("new", 3)
    assert not bm.has_table("new")
    assert snapshot(bm) == before
    bm.check_invariants()
    assert bm.can_grow("b", 4)
    bm.grow("b", 4)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_free_returns_blocks_and_double_free_raises() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.grow("a", 5)
    bm.grow("b", 2)
    assert bm.free("a") == 3
    bm.check_invariants()
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 1)
    with pytest.raises(KeyError):
        bm.free("a")
    with pytest.raises(KeyError):
        bm.free("never-seen")
    with pytest.raises(KeyError):
        bm.block_table("a")
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 1)
    bm.check_invariants()


def test_refcounts_follow_tables() -> None:
    bm = BlockManager(num_blocks=3, block_size=1, caching=True)
    bm.grow("a", 2)
    bm.register("a", [11, 12], 2)
    bm.check_invariants()
    # A shared block (a prefix cache hit) stays used until its last holder frees it.
    shared = bm.block_table("a")[0]
    hit = bm.lookup([11, 99])
    assert hit.device_blocks == (shared,)
    assert bm.admit("b", hit, 1) == (shared,)
    assert bm.refcount(shared) == 2
    bm.check_invariants()
    assert bm.free("a") == 1
    assert shared not in bm._free
    bm.check_invariants()
    assert bm.free("b") == 1
    assert bm.num_free_blocks == 3
    bm.check_invariants()


def test_non_contiguous_tables_are_handed_out() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.grow("a", 4)  # blocks 0, 1
    bm.grow("b", 4)  # blocks 2, 3
    bm.grow("c", 2)  # block 4
    bm.free("b")
    bm.free("a")
    table = bm.grow("d", 10)
    bm.check_invariants()
    assert sorted(table) == [0, 1, 2, 3, 5]
    assert list(table) != sorted(table)
    assert any(b - a != 1 for a, b in pairwise(table))
    assert bm.num_free_blocks == 0
    bm.free("c")
    bm.free("d")
    assert bm.num_free_blocks == 6
    bm.check_invariants()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda bm: bm._free.__setitem__(bm.block_table("a")[0], None), "free and referenced"),
        (lambda bm: bm._refcounts.__setitem__(bm.block_table("a")[0], 2), "refcount 2"),
        (lambda bm: bm._tables.__setitem__("ghost", [next(iter(bm._free))]), "refcount 0"),
        (lambda bm: bm._free.popitem(last=False), "neither free nor referenced"),
    ],
)
def test_check_invariants_detects_corruption(
    corrupt: Callable[[BlockManager], object], message: str
) -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.grow("a", 3)
    bm.check_invariants()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        bm.check_invariants()
