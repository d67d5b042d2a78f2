"""Prefix-cache events as typed values: what a site reports of the KV blocks it holds.

The site engine records them (site_engine/engine/prefix_cache.py), its gRPC adapter sends them in
the load stream (site.proto's CacheEvents), and the gateway's adapter hands them on as these same
values (gateway/sites/grpc_client.py): protobuf stops at the two adapters, and both sides share
one definition. Block ids are fedllm_contract.block_hash ids.

Semantics (vLLM's KV events: BlockStored / BlockRemoved / AllBlocksCleared):
- STORED: `block_hashes` are now held in `tier`, in chain order; `parent_block_hash` is the id of
  the block before the first one, 0 when the first one starts its chain (block 0 of a prompt).
- REMOVED: `block_hashes` are no longer held in `tier` (order carries no meaning).
- CLEARED: every block of every tier is gone.
A batch carries the site's `epoch`: it changes whenever the cache starts empty (a restart, a
clear), so a receiver holding ids of another epoch drops them. A `snapshot` batch lists every
block held at that moment and replaces whatever the receiver knew of the site.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CacheTier(enum.Enum):
    DEVICE = "device"
    HOST = "host"


class CacheEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class CacheEvent:
    kind: CacheEventKind
    block_hashes: tuple[int, ...] = ()
    parent_block_hash: int = 0
    tier: CacheTier = CacheTier.DEVICE


@dataclass(frozen=True, slots=True)
class CacheEventBatch:
    """The cache events of one load report (see the module docstring)."""

    epoch: int
    block_size: int
    snapshot: bool
    # Numbers a stream's batches 1, 2, ...: a receiver that sees a gap must re-subscribe.
    sequence: int
    events: tuple[CacheEvent, ...]
