"""A precise index of one site's prefix cache, fed by the site's cache events.

What it guarantees: it never claims a block that the site, according to the events it applied,
does not hold. Hence the rules:

- A snapshot replaces everything the index knew (a stream's first batch; what a re-subscription
  brings). Until the first snapshot the index is stale.
- Batches are applied in sequence. A repeated or older sequence is ignored (duplicates); a
  sequence that skips one means a batch was lost, and a lost REMOVED would leave a block the
  site no longer holds: the index goes stale, drops its entries and answers no match until the
  next snapshot. The receiver re-subscribes (ApplyOutcome.GAP says so).
- A new epoch on a stream means the site's cache started empty: the index drops its entries and
  applies the batch to nothing.
- A STORED whose parent block is not in the index is not matchable and is not recorded (llm-d's
  index drops such blocks too): an id names a block *and* its whole prefix, and a site whose
  parent we do not know of might not hold that prefix. In a snapshot, which lists only blocks
  held now, chains may come in any order: such STOREDs are retried once their parent is known.
- Bounded: at most `max_blocks` ids. A STORED beyond the bound is not recorded (counted in
  `dropped`): the index under-claims, it never over-claims.

Matching a prompt is the longest *consecutive* run of its block ids from the first that the site
holds in any tier (llm-d's longest-prefix scorer), and how many of those are on the device.
Memory: one dict entry per block held: ~70 bytes with its 64-bit key (1M blocks: 33 MB of
dict, measured with tracemalloc, plus the keys).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from itertools import takewhile

from fedllm_contract.cache_events import (
    CHAIN_START,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheEventBatch,
    Tier,
)


class ApplyOutcome(Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already applied: ignored
    STALE = "stale"  # the index waits for a snapshot: ignored
    GAP = "gap"  # a batch was lost: stale now, re-subscribe for a snapshot


class SiteCacheIndex:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: dict[int, int] = {}  # block id -> tier bits
        self._host_blocks = 0  # how many carry the host bit (0: every match is on the device)
        self.epoch: int | None = None
        self.block_size: int | None = None
        self.sequence = 0
        self.stale = True
        # Counters for /metrics and tests: blocks never recorded because their parent was
        # unknown, or because the index was full; gaps seen.
        self.orphans = 0
        self.dropped = 0
        self.gaps = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def holds(self) -> dict[int, int]:
        """Contract: a copy of every recorded block id with its tier bits (Tier values or'ed)."""
        return dict(self._blocks)

    def apply(self, batch: CacheEventBatch) -> ApplyOutcome:
        """Contract: the module docstring's rules, applied to one batch."""
        if batch.snapshot:
            self._clear()
            self.epoch, self.block_size = batch.epoch, batch.block_size
            self.sequence, self.stale = batch.sequence, False
            self._apply_snapshot(batch.events)
            return ApplyOutcome.APPLIED
        if self.stale:
            return ApplyOutcome.STALE
        if batch.sequence <= self.sequence:
            return ApplyOutcome.DUPLICATE
        if batch.sequence != self.sequence + 1 or batch.block_size != self.block_size:
            self.gaps += 1
            self.stale = True
            self._clear()
            return ApplyOutcome.GAP
        if batch.epoch != self.epoch:
            self._clear()
            self.epoch = batch.epoch
        self.sequence = batch.sequence
        for event in batch.events:
            if not self._apply(event) and isinstance(event, BlocksStored):
                self.orphans += len(event.block_ids)
        return ApplyOutcome.APPLIED

    def match(self, block_ids: Sequence[int]) -> tuple[int, int]:
        """Contract: (cached, on_device): cached is the length of the longest run of
        `block_ids` from the first that the index holds in any tier, on_device how many of those
        are held on the device; (0, 0) while stale."""
        blocks = self._blocks
        if self.stale or not blocks or not block_ids or block_ids[0] not in blocks:
            return 0, 0  # the common answer at most sites: not even the first block
        cached = len(list(takewhile(blocks.__contains__, block_ids)))
        if not self._host_blocks:
            return cached, cached
        device = sum(1 for i in range(cached) if blocks[block_ids[i]] & Tier.DEVICE)
        return cached, device

    # -- applying events ----------------------------------------------------------------------
    def _apply(self, event: CacheEvent) -> bool:
        """Applies one event; False for a STORED whose parent is unknown (not recorded)."""
        if isinstance(event, BlocksStored):
            if event.parent != CHAIN_START and event.parent not in self._blocks:
                return False
            self._store(event.block_ids, event.tier)
        elif isinstance(event, BlocksRemoved):
            self._remove(event.block_ids, event.tier)
        elif isinstance(event, AllBlocksCleared):
            self._clear()
        return True

    def _apply_snapshot(self, events: Iterable[CacheEvent]) -> None:
        pending = [event for event in events if not self._apply(event)]
        while pending:  # chains whose parent came later in the snapshot
            still = [event for event in pending if not self._apply(event)]
            if len(still) == len(pending):
                break
            pending = still
        self.orphans += sum(len(e.block_ids) for e in pending if isinstance(e, BlocksStored))

    def _store(self, block_ids: Iterable[int], tier: Tier) -> None:
        blocks = self._blocks
        for block in block_ids:
            bits = blocks.get(block)
            if bits is None:
                if len(blocks) >= self.max_blocks:
                    self.dropped += 1
                    continue
                bits = 0
            if tier == Tier.HOST and not bits & Tier.HOST:
                self._host_blocks += 1
            blocks[block] = bits | tier

    def _remove(self, block_ids: Iterable[int], tier: Tier) -> None:
        blocks = self._blocks
        for block in block_ids:
            bits = blocks.get(block)
            if bits is None or not bits & tier:
                continue
            if tier == Tier.HOST:
                self._host_blocks -= 1
            if bits & ~tier:
                blocks[block] = bits & ~tier
            else:
                del blocks[block]

    def _clear(self) -> None:
        self._blocks.clear()
        self._host_blocks = 0
