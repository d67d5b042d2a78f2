"""The host-memory tier of the prefix cache: which slots of the host KV pool hold which block ids.

A GPU cache holds a few thousand blocks while a real trace's reusable prefixes span far more, so
blocks about to be evicted from the device are copied to a larger pool in host memory and found
there by the same id once the device chain of a prompt ends (vLLM's KV offloading, LMCache). This
module only decides: slots are handed out and reclaimed least-recently-used, and every copy it
decides is listed for the model runner (site_engine/engine/host_kv.py executes them). A block may
be held in both tiers at once: a copy stays valid until its slot is reused. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict

from fedllm_contract.cache_events import Tier
from site_engine.engine.core.prefix_cache import BlockIndex, CacheEventRecorder


class HostTier:
    """`num_slots` host blocks with an LRU order over the slots that hold an id."""

    def __init__(self, num_slots: int, events: CacheEventRecorder) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.index = BlockIndex(Tier.HOST, events, num_slots)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots holding an id, LRU first
        self._pinned: frozenset[int] = frozenset()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.index

    def find(self, block_hash: int) -> int | None:
        return self.index.place_of(block_hash)

    def touch(self, slot: int) -> None:
        """`slot` was just read: the last to be reclaimed."""
        self._lru.move_to_end(slot)

    def pin(self, slots: tuple[int, ...]) -> None:
        """Keep `slots` from being reclaimed until `unpin`: a step reads them."""
        self._pinned = frozenset(slots)

    def unpin(self) -> None:
        self._pinned = frozenset()

    def store(self, block_hash: int, parent: int) -> int | None:
        """A slot for a copy of `block_hash`: a free one, or the least recently used one that
        is not pinned, whose id is forgotten; None if every slot is pinned. The caller must have
        checked that the id is not held yet."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((s for s in self._lru if s not in self._pinned), None)
            if victim is None:
                return None
            slot = victim
            del self._lru[slot]
            self.index.remove_at(slot)
        added = self.index.add(block_hash, parent, slot)
        assert added, f"block {block_hash:#x} is already in the host tier"
        self._lru[slot] = None
        return slot

    def clear(self) -> None:
        self.index.clear()
        self._lru.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def check_invariants(self) -> None:
        held = {slot for slot, _ in self.index.places()}
        if held != set(self._lru):
            raise AssertionError("host slots holding an id disagree with the LRU order")
        if held & set(self._free) or len(held) + len(self._free) != self.num_slots:
            raise AssertionError("host slots are both free and held, or some are lost")
