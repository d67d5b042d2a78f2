"""Table tests of the prefix index's rules (gateway/routing/prefix/): the event index, the
routing history and the per-site view routing reads."""

from __future__ import annotations

import pytest

from fedllm_contract.block_hash import prompt_block_hashes
from fedllm_contract.cache_events import (
    CHAIN_START,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheEventBatch,
    Tier,
)
from gateway.routing.prefix.history import HISTORY_BLOCK_TOKENS, RoutingHistory
from gateway.routing.prefix.site_index import ApplyOutcome, SiteCacheIndex
from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.routing.types import NO_MATCH, PrefixMatch, RoutingRequest

DEVICE, HOST = Tier.DEVICE, Tier.HOST


def snapshot(*events: CacheEvent, epoch: int = 1, block_size: int = 4) -> CacheEventBatch:
    return CacheEventBatch(epoch, block_size, 1, events, snapshot=True)


def batch(seq: int, *events: CacheEvent, epoch: int = 1, block_size: int = 4) -> CacheEventBatch:
    return CacheEventBatch(epoch, block_size, seq, events)


def index_after(*batches: CacheEventBatch, max_blocks: int = 100) -> SiteCacheIndex:
    index = SiteCacheIndex(max_blocks)
    for each in batches:
        index.apply(each)
    return index


CHAIN = BlocksStored((1, 2, 3), CHAIN_START)


@pytest.mark.parametrize(
    ("batches", "holds", "stale"),
    [
        ([], {}, True),  # nothing until a snapshot
        ([batch(1, CHAIN)], {}, True),  # a stream's first batch must be its snapshot
        ([snapshot(CHAIN)], {1: 1, 2: 1, 3: 1}, False),
        ([snapshot(CHAIN), batch(2, BlocksRemoved((3,)))], {1: 1, 2: 1}, False),
        ([snapshot(CHAIN), batch(2, BlocksStored((4,), 3))], {1: 1, 2: 1, 3: 1, 4: 1}, False),
        # a duplicate changes nothing
        ([snapshot(CHAIN), batch(2, BlocksRemoved((3,))), batch(2, BlocksRemoved((3,)))],
         {1: 1, 2: 1}, False),
        # batch 2 was lost (it may have removed a block): stale, nothing claimed
        ([snapshot(CHAIN), batch(3, BlocksStored((4,), 3))], {}, True),
        # a later snapshot replaces what was known
        ([snapshot(CHAIN), snapshot(BlocksStored((9,), CHAIN_START))], {9: 1}, False),
        # a new epoch: the cache started empty
        ([snapshot(CHAIN), batch(2, BlocksStored((7,), CHAIN_START), epoch=2)], {7: 1}, False),
        # the block size changed under the stream: as a gap
        ([snapshot(CHAIN), batch(2, block_size=8)], {}, True),
        ([snapshot(CHAIN), batch(2, AllBlocksCleared())], {}, False),
        # an unknown parent: not recorded, never matchable
        ([snapshot(CHAIN), batch(2, BlocksStored((5, 6), 99))], {1: 1, 2: 1, 3: 1}, False),
        # tiers: a block moved to host memory, then dropped from one tier only
        ([snapshot(CHAIN), batch(2, BlocksRemoved((3,)), BlocksStored((3,), 2, HOST))],
         {1: 1, 2: 1, 3: 2}, False),
        ([snapshot(CHAIN, BlocksStored((3,), 2, HOST)), batch(2, BlocksRemoved((3,), HOST))],
         {1: 1, 2: 1, 3: 1}, False),
        # a snapshot may list a chain before its parent's
        ([snapshot(BlocksStored((3,), 2), BlocksStored((2,), 1), BlocksStored((1,), CHAIN_START))],
         {1: 1, 2: 1, 3: 1}, False),
    ],
)  # fmt: skip
def test_event_index_rules(batches, holds, stale) -> None:
    index = index_after(*batches)
    assert (index.holds(), index.stale) == (holds, stale)


@pytest.mark.parametrize(
    ("batches", "outcome"),
    [
        ([], ApplyOutcome.STALE),  # before any snapshot
        ([batch(2)], ApplyOutcome.APPLIED),
        ([batch(2), batch(2)], ApplyOutcome.DUPLICATE),
        ([batch(2), batch(1)], ApplyOutcome.DUPLICATE),
        ([batch(3)], ApplyOutcome.GAP),
        ([batch(3), batch(4)], ApplyOutcome.STALE),  # waits for the next snapshot
    ],
)
def test_apply_says_what_happened(batches, outcome) -> None:
    index = SiteCacheIndex(10)
    if batches:
        index.apply(snapshot(CHAIN))
    outcomes = [index.apply(b) for b in batches] or [index.apply(batch(2))]
    assert outcomes[-1] == outcome


def test_orphans_and_a_full_index_are_counted() -> None:
    index = index_after(snapshot(CHAIN), batch(2, BlocksStored((5, 6), 99)), max_blocks=4)
    assert index.orphans == 2
    index.apply(batch(3, BlocksStored((4, 5, 6), 3)))  # room for one more block
    assert (len(index), index.dropped) == (4, 2)
    assert index.holds() == {1: 1, 2: 1, 3: 1, 4: 1}


@pytest.mark.parametrize(
    ("events", "prompt", "match"),
    [
        ([CHAIN], [1, 2, 3, 4], (3, 3)),
        ([CHAIN], [9, 1, 2], (0, 0)),  # a run counts from the prompt's first block
        ([CHAIN], [1, 9, 3], (1, 1)),  # consecutive: block 3 after a miss does not count
        ([CHAIN, BlocksRemoved((2,))], [1, 2, 3], (1, 1)),
        ([CHAIN, BlocksRemoved((2,)), BlocksStored((2,), 1, HOST)], [1, 2, 3], (3, 2)),
        ([], [1, 2], (0, 0)),
    ],
)
def test_a_match_is_the_held_run_and_its_device_part(events, prompt, match) -> None:
    index = index_after(snapshot(*events))
    assert index.match(prompt) == match


def test_history_forgets_the_least_recently_sent_and_a_prompts_tail_first() -> None:
    history = RoutingHistory(max_blocks=100)
    history.set_capacity_tokens(5 * HISTORY_BLOCK_TOKENS)  # the site holds 5 blocks
    history.record([1, 2, 3])
    history.record([4, 5, 6])  # one too many: 3, the oldest prompt's last block, goes
    assert history.match([1, 2, 3]) == 2
    assert history.match([4, 5, 6]) == 3
    history.record([1, 2])  # sent again: recent now
    history.record([7])  # evicts 6 then... the least recent is now 6
    assert history.match([4, 5, 6]) == 2
    assert history.match([1, 2]) == 2


def test_history_without_a_known_capacity_is_bounded_by_max_blocks() -> None:
    history = RoutingHistory(max_blocks=3)
    history.record([1, 2, 3, 4])
    assert len(history) == 3
    assert history.match([1, 2, 3]) == 3  # the first blocks are kept, the tail went


TOKENS = tuple(range(1000, 1000 + 3 * HISTORY_BLOCK_TOKENS + 5))


def req(tokens: tuple[int, ...], salt: str = "") -> RoutingRequest:
    return RoutingRequest("m", len(tokens), 10, prompt_token_ids=tokens, cache_salt=salt)


def test_a_site_without_events_matches_what_it_was_sent() -> None:
    site = SitePrefix(max_blocks=100)
    assert site.match(req(TOKENS)) == NO_MATCH
    site.routed(req(TOKENS[: 2 * HISTORY_BLOCK_TOKENS]))
    full = 2 * HISTORY_BLOCK_TOKENS
    assert site.match(req(TOKENS)) == PrefixMatch(full, full)
    assert site.match(req(TOKENS, salt="other tenant")) == NO_MATCH
    assert (site.mode, site.blocks) == ("history", 2)


def test_a_site_with_events_matches_only_what_its_events_say() -> None:
    site = SitePrefix(max_blocks=100)
    site.routed(req(TOKENS))  # history: forgotten once events are followed
    ids = prompt_block_hashes(TOKENS, 16, "m")
    assert site.apply(snapshot(BlocksStored(tuple(ids[:5]), CHAIN_START), block_size=16)) is (
        ApplyOutcome.APPLIED
    )
    assert site.match(req(TOKENS)) == PrefixMatch(5 * 16, 5 * 16)
    site.routed(req(TOKENS))  # nothing learnt from routing now
    assert (site.mode, site.blocks) == ("events", 5)
    assert site.apply(batch(3, block_size=16)) is ApplyOutcome.GAP
    assert (site.match(req(TOKENS)), site.stale) == (NO_MATCH, True)


def test_block_ids_are_computed_once_per_block_size() -> None:
    request = req(TOKENS)
    first = request.block_ids(16)
    assert request.block_ids(16) is first
    assert first == tuple(prompt_block_hashes(TOKENS, 16, "m"))
    assert len(request.block_ids(64)) == len(TOKENS) // 64
