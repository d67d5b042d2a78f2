"""A site's prefix cache as the tests drive it: the truth that cache events describe, and one
stream of batches per subscriber (each with its own sequence numbers, a snapshot first, and the
truth after each of its batches, to judge a receiver by)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedllm_contract.cache_events import (
    CHAIN_START,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheEventBatch,
    Tier,
)

BLOCK_SIZE = 16


@dataclass
class Stream:
    sequence: int = 0
    pending: list[CacheEvent] = field(default_factory=list)
    # The site's truth right after each batch of this stream, by sequence.
    truths: dict[int, dict[int, int]] = field(default_factory=dict)


@dataclass
class CacheSite:
    """held: block id -> tier bits (the truth)."""

    held: dict[int, int] = field(default_factory=dict)
    parents: dict[int, int] = field(default_factory=dict)
    epoch: int = 1
    next_id: int = 1
    streams: list[Stream] = field(default_factory=list)

    def _emit(self, event: CacheEvent) -> None:
        for stream in self.streams:
            stream.pending.append(event)

    def store_chain(self, parent: int, length: int, tier: Tier = Tier.DEVICE) -> list[int]:
        ids = list(range(self.next_id, self.next_id + length))
        self.next_id += length
        before = parent
        for block in ids:
            self.held[block] = self.held.get(block, 0) | tier
            self.parents[block] = before
            before = block
        self._emit(BlocksStored(tuple(ids), parent, tier))
        return ids

    def remove(self, blocks: list[int], tier: Tier) -> None:
        gone = [b for b in blocks if self.held.get(b, 0) & tier]
        for block in gone:
            self.held[block] &= ~tier
            if not self.held[block]:
                del self.held[block]
        if gone:
            self._emit(BlocksRemoved(tuple(gone), tier))

    def move_to_host(self, blocks: list[int]) -> None:
        """The blocks' copies go to host memory (evicted from the device), each while its parent
        is still held: a site stores a block only while the block before it is held (vLLM frees
        a request's last blocks first)."""
        moving = [
            b
            for b in blocks
            if self.held.get(b, 0) & Tier.DEVICE
            and (self.parents[b] == CHAIN_START or self.parents[b] in self.held)
        ]
        self.remove(moving, Tier.DEVICE)
        for block in moving:
            self.held[block] = self.held.get(block, 0) | Tier.HOST
        for block in moving:
            self._emit(BlocksStored((block,), self.parents[block], Tier.HOST))

    def clear(self) -> None:
        """The site drops every block and says so."""
        self.held.clear()
        self._emit(AllBlocksCleared())

    def start_over(self) -> None:
        """The site's cache starts over empty without a word but a new epoch (the batches of
        the old epoch were sent before: a batch's events all belong to its epoch)."""
        self.held.clear()
        self.epoch += 1

    def batch(self, stream: Stream) -> CacheEventBatch:
        stream.sequence += 1
        events, stream.pending = tuple(stream.pending), []
        stream.truths[stream.sequence] = dict(self.held)
        return CacheEventBatch(self.epoch, BLOCK_SIZE, stream.sequence, events)

    def subscribe(self, stream: Stream | None = None) -> tuple[Stream, CacheEventBatch]:
        """A new stream (or `stream` started over): its first batch is a snapshot of every block
        held now, one STORED per block and tier, children before parents (the order a site may
        list them in), sequence 1."""
        if stream is None:
            stream = Stream()
            self.streams.append(stream)
        stream.sequence, stream.pending, stream.truths = 1, [], {1: dict(self.held)}
        events: list[CacheEvent] = [
            BlocksStored((block,), self.parents[block], tier)
            for block, bits in sorted(self.held.items(), reverse=True)
            for tier in (Tier.DEVICE, Tier.HOST)
            if bits & tier
        ]
        return stream, CacheEventBatch(self.epoch, BLOCK_SIZE, 1, tuple(events), snapshot=True)

    def restart(self) -> None:
        """The site process restarts: an empty cache, a new epoch; every stream breaks."""
        self.held.clear()
        self.parents.clear()
        self.epoch += 1
        for stream in self.streams:
            stream.pending = []
