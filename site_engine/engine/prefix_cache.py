"""Where cached KV blocks are, by block id, and the events that tell the gateway about them.

A cached block is a full block of tokens whose KV is (or is being) written, named by its chained
id (fedllm_contract/block_hash.py: the id covers the block's tokens, every token before them, the
model and the cache salt). `BlockIndex` maps ids to places in one tier: device block numbers for
the GPU cache (site_engine/engine/block_manager.py), slots for the host-memory tier
(site_engine/engine/host_tier.py). It keeps each id's parent so that the ids it holds can be
listed as chains for a snapshot. One id names one place: a second block that fills with the same
tokens (two requests computing one prefix side by side) stays unindexed, as vLLM leaves duplicate
blocks out of its lookups.

`CacheEventRecorder` collects what changed (BlocksStored / BlocksRemoved / AllBlocksCleared),
merging a run of stored blocks of one chain, or of removals, into one event. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fedllm_contract.cache_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    Tier,
)


class CacheEventRecorder:
    """What changed in the cache since the last `take`."""

    def __init__(self) -> None:
        self._events: list[CacheEvent] = []

    def stored(self, tier: Tier, block_hash: int, parent: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlocksStored) and last.tier is tier and last.block_ids[-1] == parent:
            self._events[-1] = BlocksStored((*last.block_ids, block_hash), last.parent, tier)
            return
        self._events.append(BlocksStored((block_hash,), parent, tier))

    def removed(self, tier: Tier, block_hash: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlocksRemoved) and last.tier is tier:
            self._events[-1] = BlocksRemoved((*last.block_ids, block_hash), tier)
            return
        self._events.append(BlocksRemoved((block_hash,), tier))

    def cleared(self) -> None:
        # Whatever came before is moot: a receiver drops everything on AllBlocksCleared.
        self._events = [AllBlocksCleared()]

    def take(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events


class BlockIndex:
    """Block id <-> place (device block or host slot) of one tier, with each id's parent."""

    def __init__(self, tier: Tier, events: CacheEventRecorder) -> None:
        self.tier = tier
        self._events = events
        self._place_of: dict[int, int] = {}
        self._hash_at: dict[int, int] = {}
        self._parent_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._place_of)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._place_of

    def place_of(self, block_hash: int) -> int | None:
        return self._place_of.get(block_hash)

    def hash_at(self, place: int) -> int | None:
        return self._hash_at.get(place)

    def parent_of(self, block_hash: int) -> int:
        return self._parent_of[block_hash]

    def add(self, block_hash: int, parent: int, place: int) -> bool:
        """Index `place` as holding `block_hash`; False (nothing changed) if the id is already
        held elsewhere or the place already holds an id."""
        if block_hash in self._place_of or place in self._hash_at:
            return False
        self._place_of[block_hash] = place
        self._hash_at[place] = block_hash
        self._parent_of[block_hash] = parent
        self._events.stored(self.tier, block_hash, parent)
        return True

    def remove_at(self, place: int) -> int | None:
        """Forget what `place` holds (it is about to be overwritten); returns the id, if any."""
        block_hash = self._hash_at.pop(place, None)
        if block_hash is not None:
            del self._place_of[block_hash]
            del self._parent_of[block_hash]
            self._events.removed(self.tier, block_hash)
        return block_hash

    def clear(self) -> None:
        self._place_of.clear()
        self._hash_at.clear()
        self._parent_of.clear()

    def places(self) -> Iterator[tuple[int, int]]:
        """(place, id) of every indexed place."""
        return iter(self._hash_at.items())

    def chains(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every id held, as (parent, ids in chain order) runs: each run's first id has a parent
        that is not held here (or 0), or is a second child of a held block."""
        children: dict[int, list[int]] = {}
        for block_hash, parent in self._parent_of.items():
            children.setdefault(parent, []).append(block_hash)
        runs: list[tuple[int, tuple[int, ...]]] = []
        starts = [(p, h) for h, p in self._parent_of.items() if p not in self._place_of]
        while starts:
            parent, block_hash = starts.pop()
            run = [block_hash]
            while True:
                kids = children.get(run[-1], [])
                starts.extend((run[-1], kid) for kid in kids[1:])
                if not kids:
                    break
                run.append(kids[0])
            runs.append((parent, tuple(run)))
        return runs


def snapshot_events(indexes: Iterable[BlockIndex]) -> list[CacheEvent]:
    """BlocksStored events listing every block the indexes hold, chain by chain."""
    return [
        BlocksStored(run, parent, index.tier) for index in indexes for parent, run in index.chains()
    ]
