"""Adapters in the KV cache's memory (issue 69, S-LoRA's unified paging): device adapter slots
are not a fixed count but come out of the KV cache's block pool. Pure Python.

A resident adapter holds `blocks_per_adapter` blocks of the pool (its weights' bytes over a
block's, rounded up), as a table of the BlockManager under a name no request id takes: the
scheduler sees as many fewer free blocks, exactly as for a sequence. Slots grow while the pool
has room and shrink when sequences need it: an adapter no running sequence uses is idle, and
idle ones give their blocks back before any sequence is preempted or refused for blocks
(`evict_one`). `max_loras` is a cap on how many are resident at once, not the plan.

Eviction order: the idle adapter with the least waiting demand (requests waiting for it), then
the least recently used. Prefetch: an adapter of a waiting request takes its blocks before the
request is admitted, while the pool has room beyond the watermark (the runner writes its weights
at the next step, before the request's first chunk needs them).

Each resident adapter also has a slot index below the cap (the index of the device tensors the
runner writes its weights into: SchedulerOutput.adapter_slots); an adapter keeps its index while
resident, so a step in flight never sees its slot change under it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection

from site_engine.engine.core.block_manager import BlockManager

# An adapter's table in the BlockManager: a NUL-led id, which the scheduler refuses as a
# request id while slots are unified.
_TABLE = "\x00lora:"


def table_id(adapter: str) -> str:
    """The BlockManager table id of `adapter`'s blocks."""
    return _TABLE + adapter


def is_adapter_table(table: str) -> bool:
    return table.startswith(_TABLE)


class UnifiedSlots:
    """The resident adapters, each holding `blocks_per_adapter` blocks of `blocks`."""

    def __init__(self, blocks: BlockManager, blocks_per_adapter: int, cap: int) -> None:
        if blocks_per_adapter < 1 or cap < 1:
            raise ValueError(f"blocks per adapter ({blocks_per_adapter}) and cap ({cap}) >= 1")
        self._blocks = blocks
        self.blocks_per_adapter = blocks_per_adapter
        self.cap = cap
        self._slot: dict[str, int] = {}
        self._last_used: dict[str, int] = {}  # adapter -> the step that last used it
        self._clock = 0
        self.loads = 0  # adapters given blocks since start (each a write of its weights)
        self.evictions = 0
        self.changed = False  # the mapping changed since `take_mapping`

    def slot_of(self, adapter: str) -> int | None:
        return self._slot.get(adapter)

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def num_blocks(self) -> int:
        """Blocks the resident adapters hold."""
        return len(self._slot) * self.blocks_per_adapter

    def idle(self, in_use: Collection[str]) -> list[str]:
        """The resident adapters none of `in_use` names (free to evict)."""
        return [name for name in self._slot if name not in in_use]

    def idle_blocks(self, in_use: Collection[str]) -> int:
        return len(self.idle(in_use)) * self.blocks_per_adapter

    def touch(self, adapters: Collection[str]) -> None:
        """`adapters` run in this step (their recency)."""
        self._clock += 1
        for name in adapters:
            if name in self._slot:
                self._last_used[name] = self._clock

    def take(
        self, adapter: str, in_use: Collection[str], demand: Callable[[], Counter[str]]
    ) -> bool:
        """Makes `adapter` resident (it is now, or its blocks and a slot were had), evicting
        idle adapters (none of `in_use`) if need be; False, evicting none, if even evicting
        every idle one would not make room. `demand`: waiting requests by adapter."""
        if adapter in self._slot:
            self._last_used[adapter] = self._clock
            return True
        need = self.blocks_per_adapter
        idle = self.idle(in_use)
        if self._blocks.num_free_blocks + len(idle) * need < need:
            return False
        if len(self._slot) >= self.cap and not idle:
            return False
        counts = demand() if idle else Counter()
        order = sorted(idle, key=lambda name: (counts[name], self._last_used[name]))
        while self._blocks.num_free_blocks < need or len(self._slot) >= self.cap:
            self._evict(order.pop(0))
        self._load(adapter)
        return True

    def prefetch(self, adapter: str, keep_free: int) -> bool:
        """Makes `adapter` (of a waiting request) resident if a slot is free under the cap and
        the pool keeps `keep_free` blocks free after it; evicts nothing."""
        if adapter in self._slot:
            return True
        if len(self._slot) >= self.cap:
            return False
        if self._blocks.num_free_blocks - self.blocks_per_adapter < keep_free:
            return False
        self._load(adapter)
        return True

    def evict_one(self, in_use: Collection[str], demand: Callable[[], Counter[str]]) -> bool:
        """Gives an idle adapter's blocks back to the pool (sequences need them); False if
        none is idle."""
        idle = self.idle(in_use)
        if not idle:
            return False
        counts = demand()
        self._evict(min(idle, key=lambda name: (counts[name], self._last_used[name])))
        return True

    def drop(self, adapter: str) -> None:
        """`adapter` is no longer served: its blocks go back (it must be idle)."""
        if adapter in self._slot:
            self._evict(adapter)

    def take_mapping(self) -> tuple[tuple[str, int], ...] | None:
        """Each resident adapter's slot if the mapping changed since the last call, else None
        (what the runner is told with a step)."""
        if not self.changed:
            return None
        self.changed = False
        return tuple(sorted(self._slot.items(), key=lambda item: item[1]))

    def _load(self, adapter: str) -> None:
        used = set(self._slot.values())
        slot = next(index for index in range(self.cap) if index not in used)
        self._blocks.grow(table_id(adapter), self.blocks_per_adapter * self._blocks.block_size)
        self._slot[adapter] = slot
        self._last_used[adapter] = self._clock
        self.loads += 1
        self.changed = True

    def _evict(self, adapter: str) -> None:
        self._blocks.free(table_id(adapter))
        del self._slot[adapter]
        del self._last_used[adapter]
        self.evictions += 1
        self.changed = True

    def check(self) -> None:
        """AssertionError if the slots and the pool's tables disagree (tests)."""
        tables = {t for t in self._blocks.request_ids() if is_adapter_table(t)}
        if tables != {table_id(name) for name in self._slot}:
            raise AssertionError(f"adapter tables {sorted(tables)} != residents {self._slot}")
        if len(set(self._slot.values())) != len(self._slot) or len(self._slot) > self.cap:
            raise AssertionError(f"slots {self._slot} repeat or exceed the cap {self.cap}")
        for name in self._slot:
            if self._blocks.num_held(table_id(name)) != self.blocks_per_adapter:
                raise AssertionError(f"adapter {name!r} holds the wrong number of blocks")
