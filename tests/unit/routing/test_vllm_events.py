"""vLLM's KV events translated into our block ids (gateway/routing/prefix/vllm_events.py): the
ids are ours whatever hashes the engine uses, and what cannot be translated is left out."""

from __future__ import annotations

import msgspec
import pytest

from fedllm_contract.block_hash import prompt_block_hashes
from fedllm_contract.cache_events import (
    CHAIN_START,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    Tier,
)
from gateway.routing.prefix.site_index import SiteCacheIndex
from gateway.routing.prefix.vllm_events import MalformedEvents, VllmEventTranslator
from tests.unit.routing.vllm_wire import VllmEngine, all_blocks_cleared, encode

PROMPT = list(range(500, 500 + 70))  # 4 full blocks of 16 and 6 tokens
LONGER = [*PROMPT[:64], *range(9000, 9040)]  # shares the first 4 blocks, 6 full blocks


def ours(tokens: list[int], salt: str = "") -> tuple[int, ...]:
    return tuple(prompt_block_hashes(tokens, 16, "m", salt))


@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("array_like", [True, False])
def test_stored_blocks_get_our_ids(as_bytes, array_like) -> None:
    engine = VllmEngine(as_bytes=as_bytes, array_like=array_like)
    translator = VllmEventTranslator("m", 16, max_blocks=100)
    first = translator.translate(encode([engine.store(PROMPT)], array_like))
    assert first.events == (BlocksStored(ours(PROMPT), CHAIN_START, Tier.DEVICE),)
    assert (first.snapshot, first.sequence, first.block_size) == (True, 1, 16)
    # the longer prompt: vLLM stores only its two new blocks, under its own parent hash
    second = translator.translate(encode([engine.store(LONGER, start_block=4)], array_like))
    assert second.events == (BlocksStored(ours(LONGER)[4:], ours(LONGER)[3], Tier.DEVICE),)
    assert (second.snapshot, second.sequence) == (False, 2)


def test_the_cache_salt_of_the_first_block_seeds_the_chain() -> None:
    engine = VllmEngine(array_like=False)
    translator = VllmEventTranslator("m", 16, max_blocks=100)
    batch = translator.translate(encode([engine.store(PROMPT, salt="key-7")], array_like=False))
    assert batch.events == (BlocksStored(ours(PROMPT, "key-7"), CHAIN_START, Tier.DEVICE),)


@pytest.mark.parametrize(
    ("kwargs", "tier"),
    [
        ({"medium": "GPU"}, Tier.DEVICE),
        ({"medium": "CPU"}, Tier.HOST),
        ({"medium": "DISK"}, None),  # a tier we do not model
        ({"lora": 3}, None),  # an adapter's blocks: another cache
    ],
)
def test_tiers_and_what_is_left_out(kwargs, tier) -> None:
    translator = VllmEventTranslator("m", 16, max_blocks=100)
    batch = translator.translate(encode([VllmEngine().store(PROMPT, **kwargs)]))
    expected = () if tier is None else (BlocksStored(ours(PROMPT), CHAIN_START, tier),)
    assert batch.events == expected
    assert translator.skipped == (tier is None)


def test_a_parent_never_seen_is_not_matchable() -> None:
    engine = VllmEngine()
    engine.store(PROMPT)  # stored before the gateway listened
    translator = VllmEventTranslator("m", 16, max_blocks=100)
    batch = translator.translate(encode([engine.store(LONGER, start_block=4)]))
    assert (batch.events, translator.skipped) == ((), 1)


def test_removals_clears_and_a_restart() -> None:
    engine = VllmEngine()
    translator = VllmEventTranslator("m", 16, max_blocks=100)
    translator.translate(encode([engine.store(PROMPT)]))
    gone = engine.hashes_of(PROMPT)[2:]
    batch = translator.translate(encode([engine.removed([*gone, 12345]), all_blocks_cleared()]))
    assert batch.events == (BlocksRemoved(ours(PROMPT)[2:], Tier.DEVICE), AllBlocksCleared())
    translator.restart()
    after = translator.translate(encode([engine.removed(gone)]))
    assert (after.snapshot, after.epoch, after.sequence, after.events) == (True, 2, 1, ())


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode([1, 2, 3]),  # no list of events
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [7]]),  # an event without a tag
        msgspec.msgpack.encode([1.0, [["BlockRemoved", ["not a hash"], None]]]),
    ],
)
def test_a_payload_that_is_not_a_kv_event_batch_is_refused(payload) -> None:
    with pytest.raises(MalformedEvents):
        VllmEventTranslator("m", 16, max_blocks=100).translate(payload)


def test_an_index_fed_by_vllm_events_matches_our_prompts() -> None:
    engine, index = VllmEngine(), SiteCacheIndex(100)
    translator = VllmEventTranslator("m", 16, max_blocks=100)
    index.apply(translator.translate(encode([engine.store(PROMPT)])))
    index.apply(translator.translate(encode([engine.store(LONGER, start_block=4)])))
    assert index.match(ours(LONGER)) == (6, 6)
    assert index.match(ours(PROMPT, "another key")) == (0, 0)
