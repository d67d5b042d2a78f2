"""Where cached KV blocks are, by block id, and the events that tell the gateway about them.

A cached block is a full block of tokens whose KV is (or is being) written, named by its chained
id (fedllm_contract/block_hash.py: the id covers the block's tokens, every token before them, the
model and the cache salt). `BlockIndex` maps ids to places in one tier: device block numbers for
the GPU cache (site_engine/engine/core/block_manager.py), slots for the host-memory tier
(site_engine/engine/core/host_tier.py). It keeps each id's parent so that the ids it holds can be
listed as chains for a snapshot. One id names one place: a second block that fills with the same
tokens (two requests computing one prefix side by side) stays unindexed, as vLLM leaves duplicate
blocks out of its lookups.

`CacheEventRecorder` collects what changed (BlocksStored / BlocksRemoved / AllBlocksCleared),
merging a run of stored blocks of one chain, or of removals, into one event. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from fedllm_contract.cache_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    Tier,
)

# The kinds of a recorded change (CacheEventRecorder's flat records).
_STORED, _REMOVED, _CLEARED = 0, 1, 2


class CacheEventRecorder:
    """What changed in the cache since the last `take`.

    A change is recorded as a flat tuple (kind, tier, id, parent) appended to one list, the
    cheapest record Python has: a step at 1,024 sequences fills and evicts dozens of blocks, and
    building (and re-building, to merge) event objects for each one cost the step's host time
    (bench.engine.scheduler_overhead). `take` turns a step's records into events once, merging a
    run of stored blocks of one chain, or of removals, into one event as they came.
    """

    def __init__(self) -> None:
        # Appended to by `BlockIndex.add_all` directly (one step's filled blocks in one loop).
        self.records: list[tuple[int, Tier, int, int]] = []

    def stored(self, tier: Tier, block_hash: int, parent: int) -> None:
        self.records.append((_STORED, tier, block_hash, parent))

    def removed(self, tier: Tier, block_hash: int) -> None:
        self.records.append((_REMOVED, tier, block_hash, 0))

    def cleared(self) -> None:
        # Whatever came before is moot: a receiver drops everything on AllBlocksCleared.
        self.records = [(_CLEARED, Tier.DEVICE, 0, 0)]

    def take(self) -> list[CacheEvent]:
        records, self.records = self.records, []
        return _merged_events(records) if records else []


def _merged_events(records: list[tuple[int, Tier, int, int]]) -> list[CacheEvent]:
    """Events from records in order: a stored id whose parent is the last id of a run of stored
    ids of its tier extends that run, a removal extends a run of removals of its tier."""
    events: list[CacheEvent] = []
    append = events.append
    kind, tier, parent, last = -1, Tier.DEVICE, 0, 0
    ids: list[int] = []
    # A step's records are mostly single stored blocks of distinct sequences: each event is
    # built inline, without a call per run beyond the event's own constructor.
    for record_kind, record_tier, block_hash, record_parent in records:
        same_run = ids and record_kind == kind and record_tier is tier
        if same_run and (kind == _REMOVED or last == record_parent):
            ids.append(block_hash)
            last = block_hash
            continue
        if ids:
            if kind == _STORED:
                append(BlocksStored(tuple(ids), parent, tier))
            else:
                append(BlocksRemoved(tuple(ids), tier))
        if record_kind == _CLEARED:
            append(AllBlocksCleared())
            ids = []
            continue
        kind, tier, parent, last, ids = (
            record_kind, record_tier, record_parent, block_hash, [block_hash]
        )  # fmt: skip
    if ids:
        if kind == _STORED:
            append(BlocksStored(tuple(ids), parent, tier))
        else:
            append(BlocksRemoved(tuple(ids), tier))
    return events


class BlockIndex:
    """Block id <-> place (device block or host slot, 0 .. num_places - 1) of one tier, with
    each id's parent.

    What is kept by place (the id a place holds, its parent) is kept in lists indexed by place
    rather than dicts: a step indexes dozens of filled blocks and frees or hands out as many,
    and a list slot costs no hashing (bench.engine.scheduler_overhead, issue 50)."""

    def __init__(self, tier: Tier, events: CacheEventRecorder, num_places: int) -> None:
        if num_places < 1:
            raise ValueError(f"num_places must be >= 1, got {num_places}")
        self.tier = tier
        self._events = events
        self._place_of: dict[int, int] = {}
        self._hash_at: list[int | None] = [None] * num_places
        self._parent_at = [0] * num_places
        # Admissions that found each held id (the host tier copies blocks hit before,
        # site_engine/engine/core/host_offload.py); an id never hit has no entry.
        self._hits: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._place_of)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._place_of

    @property
    def ids_at(self) -> Sequence[int | None]:
        """place -> the id it holds (None: none), live and the same list for the index's life:
        the block manager reads it for every block it frees or hands out."""
        return self._hash_at

    def place_of(self, block_hash: int) -> int | None:
        return self._place_of.get(block_hash)

    def hash_at(self, place: int) -> int | None:
        return self._hash_at[place]

    def parent_of(self, block_hash: int) -> int:
        return self._parent_at[self._place_of[block_hash]]

    def record_hit(self, block_hash: int) -> None:
        """An admission found `block_hash` held here (or brought it back to here)."""
        if block_hash in self._place_of:
            self._hits[block_hash] = self._hits.get(block_hash, 0) + 1

    def hits_of(self, block_hash: int) -> int:
        return self._hits.get(block_hash, 0)

    def add(self, block_hash: int, parent: int, place: int) -> bool:
        """Index `place` as holding `block_hash`; False (nothing changed) if the id is already
        held elsewhere or the place already holds an id."""
        if block_hash in self._place_of or self._hash_at[place] is not None:
            return False
        self._place_of[block_hash] = place
        self._hash_at[place] = block_hash
        self._parent_at[place] = parent
        self._events.stored(self.tier, block_hash, parent)
        return True

    def add_all(self, entries: Iterable[tuple[int, int, int]]) -> None:
        """`add` of each (id, parent, place) in order, in one call: the blocks that filled in
        one step."""
        place_of, hash_at, parent_at = self._place_of, self._hash_at, self._parent_at
        record = self._events.records.append
        tier = self.tier
        for block_hash, parent, place in entries:
            if block_hash in place_of or hash_at[place] is not None:
                continue
            place_of[block_hash] = place
            hash_at[place] = block_hash
            parent_at[place] = parent
            record((_STORED, tier, block_hash, parent))

    def leading_places(self, hashes: Iterable[int]) -> list[int]:
        """The places of the longest run of `hashes`, from the first, held here."""
        place_of = self._place_of
        places: list[int] = []
        for block_hash in hashes:
            place = place_of.get(block_hash)
            if place is None:
                break
            places.append(place)
        return places

    def remove_at(self, place: int) -> int | None:
        """Forget what `place` holds (it is about to be overwritten); returns the id, if any."""
        block_hash = self._hash_at[place]
        if block_hash is not None:
            self._hash_at[place] = None
            del self._place_of[block_hash]
            self._hits.pop(block_hash, None)
            self._events.removed(self.tier, block_hash)
        return block_hash

    def clear(self) -> None:
        self._place_of.clear()
        hash_at = self._hash_at
        hash_at[:] = [None] * len(hash_at)  # the same list: `ids_at` stays live
        self._hits.clear()

    def places(self) -> Iterator[tuple[int, int]]:
        """(place, id) of every indexed place, in the order they were indexed."""
        return ((place, block_hash) for block_hash, place in self._place_of.items())

    def chains(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every id held, as (parent, ids in chain order) runs: each run's first id has a parent
        that is not held here (or 0), or is a second child of a held block."""
        parent_at = self._parent_at
        parent_of = {h: parent_at[place] for h, place in self._place_of.items()}
        children: dict[int, list[int]] = {}
        for block_hash, parent in parent_of.items():
            children.setdefault(parent, []).append(block_hash)
        runs: list[tuple[int, tuple[int, ...]]] = []
        starts = [(p, h) for h, p in parent_of.items() if p not in self._place_of]
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
