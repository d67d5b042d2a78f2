"""The prefix index's input: what a site says about its prefix cache, as typed values.

These mirror the CacheEvents of fedllm_contract/proto/site.proto (our engines' load reports) and
are what vLLM's KV events are translated into (vllm_events.py); the adapters that receive either
build them, so the index never sees a protobuf or a msgpack map.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

# A STORED whose first block starts a chain names this parent (the proto's 0).
CHAIN_START = 0


class Tier(IntEnum):
    """Where a cached block lives (the proto's CacheTier); the values are the index's bits."""

    DEVICE = 1
    HOST = 2


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Blocks now held in `tier`, in chain order; `parent` is the id of the block before the
    first one (CHAIN_START when the first starts a chain). A site stores a block only while the
    block before it is held (it was computed from it); one that does not is indexed as unknown."""

    block_ids: tuple[int, ...]
    parent: int = CHAIN_START
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks no longer held in `tier`."""

    block_ids: tuple[int, ...]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of every tier dropped."""


CacheEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class CacheEventBatch:
    """What one load report (or one translated vLLM batch) says changed.

    epoch changes whenever the site's cache starts empty (a restart, a clear), and a batch's
    events all belong to its epoch; block_size is the tokens per block its ids are computed
    over; a snapshot lists every block held now and replaces what the receiver knew; sequence
    numbers a stream's batches 1, 2, ... so that a receiver can tell a lost batch (a gap) from a
    repeated one."""

    epoch: int
    block_size: int
    sequence: int
    events: tuple[CacheEvent, ...] = ()
    snapshot: bool = False
