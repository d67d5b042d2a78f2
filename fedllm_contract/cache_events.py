"""Prefix-cache events as typed values: what a site reports of the KV blocks it holds.

The one definition both sides share. The site engine records them
(site_engine/engine/core/prefix_cache.py), its gRPC adapter sends them in the load stream
(site.proto's CacheEvents), the gateway's adapter builds these same values from the protobuf
(gateway/sites/grpc_client.py), vLLM's KV events are translated into them
(gateway/routing/prefix/vllm_events.py), and the prefix index applies them
(gateway/routing/prefix/site_index.py): protobuf and msgpack stop at the adapters, so the index
never sees either, and the two sides cannot drift. Block ids are fedllm_contract.block_hash ids.

The events follow vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared): see each class.
A batch carries the site's `epoch`: it changes whenever the cache starts empty (a restart, a
clear), so a receiver holding ids of another epoch drops them. A `snapshot` batch lists every
block held at that moment and replaces whatever the receiver knew of the site.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

# A BlocksStored whose first block starts a chain (block 0 of a prompt) names this parent (the
# proto's 0).
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
    """Blocks no longer held in `tier` (their order carries no meaning)."""

    block_ids: tuple[int, ...]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of every tier dropped."""


CacheEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class CacheEventBatch:
    """The cache events of one load report (or of one translated vLLM batch).

    epoch changes whenever the site's cache starts empty (a restart, a clear), and a batch's
    events all belong to its epoch; block_size is the tokens per block its ids are computed
    over; a snapshot lists every block held now and replaces what the receiver knew; sequence
    numbers a stream's batches 1, 2, ... so that a receiver can tell a lost batch (a gap: it
    must re-subscribe) from a repeated one."""

    epoch: int
    block_size: int
    sequence: int
    events: tuple[CacheEvent, ...] = ()
    snapshot: bool = False
