"""Prefix-cache events through the two gRPC adapters: what the site's adapter writes, the
gateway's reads back as the same values (one definition on both sides, so nothing to translate),
and an event the gateway cannot read is dropped rather than guessed at."""

from __future__ import annotations

from typing import cast

from fedllm_contract.cache_events import (
    CHAIN_START,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEventBatch,
    Tier,
)
from fedllm_contract.proto import site_pb2
from gateway.sites.grpc_client import _cache_events_from_proto
from site_engine.grpc_server import _cache_events_to_proto

# Values a newer site might send (proto3 enums are open: they arrive as plain numbers).
UNKNOWN_TIER = cast(site_pb2.CacheTier.ValueType, 9)
UNKNOWN_KIND = cast(site_pb2.CacheEvent.Kind.ValueType, 9)


def over_the_wire(batch: CacheEventBatch) -> CacheEventBatch:
    message = site_pb2.CacheEvents.FromString(_cache_events_to_proto(batch).SerializeToString())
    return _cache_events_from_proto(message)


def test_every_event_and_tier_arrives_as_sent() -> None:
    batch = CacheEventBatch(
        epoch=(1 << 63) - 1,
        block_size=16,
        sequence=7,
        events=(
            BlocksStored((1, (1 << 64) - 1), CHAIN_START, Tier.DEVICE),
            BlocksStored((3,), 2, Tier.HOST),
            BlocksRemoved((1,), Tier.DEVICE),
            BlocksRemoved((3, 2), Tier.HOST),
            AllBlocksCleared(),
        ),
        snapshot=True,
    )
    assert over_the_wire(batch) == batch
    assert over_the_wire(CacheEventBatch(2, 4, 1)) == CacheEventBatch(2, 4, 1)


def test_an_event_of_an_unknown_kind_or_tier_is_dropped() -> None:
    message = site_pb2.CacheEvents(
        epoch=1,
        block_size=16,
        sequence=1,
        events=[
            site_pb2.CacheEvent(
                kind=site_pb2.CacheEvent.STORED, block_hashes=[5], tier=UNKNOWN_TIER
            ),
            site_pb2.CacheEvent(kind=site_pb2.CacheEvent.CLEARED, tier=UNKNOWN_TIER),
            site_pb2.CacheEvent(kind=UNKNOWN_KIND, block_hashes=[6]),
            site_pb2.CacheEvent(kind=site_pb2.CacheEvent.REMOVED, block_hashes=[7]),
        ],
    )
    batch = _cache_events_from_proto(message)
    assert batch.events == (BlocksRemoved((7,), Tier.DEVICE),)
