"""Which physical KV blocks each sequence holds: block tables, a free list and refcounts.

A sequence's memory grows with its real tokens: `grow` only allocates the blocks missing to cover
the requested number of token slots. Physical blocks come from a FIFO free list, so a table is in
general not contiguous; the model runner addresses the cache through the table and does not care.
Refcounts are kept per block (not a per-table "owned" flag) so that blocks can later be shared
between tables, e.g. by prefix caching, without changing the accounting.
"""

from __future__ import annotations

from collections import Counter, deque


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for a `grow`; the manager's state is unchanged."""

    def __init__(self, request_id: str, needed: int, free: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {needed} more KV block(s), only {free} free"
        )
        self.request_id = request_id
        self.needed = needed
        self.free = free


class BlockManager:
    """Fixed-size KV blocks handed out to per-sequence block tables."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refcounts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that cover `num_tokens` token slots."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self._block_size)

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def request_ids(self) -> frozenset[str]:
        """Sequences that currently hold a table (possibly empty)."""
        return frozenset(self._tables)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The physical blocks of `request_id` in logical order; KeyError if it has no table."""
        return tuple(self._tables[request_id])

    def _missing_blocks(self, request_id: str, num_tokens_total: int) -> int:
        held = len(self._tables.get(request_id, ()))
        if held * self._block_size >= num_tokens_total >= 0:
            return 0  # the common decode step: the last block still has room
        return max(self.blocks_needed(num_tokens_total) - held, 0)

    def can_grow(self, request_id: str, num_tokens_total: int) -> bool:
        """Whether `grow(request_id, num_tokens_total)` would succeed now."""
        return self._missing_blocks(request_id, num_tokens_total) <= len(self._free)

    def grow(self, request_id: str, num_tokens_total: int) -> tuple[int, ...]:
        """Make the table of `request_id` cover `num_tokens_total` token slots.

        Creates the table on first use (an empty one for 0 tokens) and never shrinks it. Raises
        OutOfBlocks, with nothing allocated, if the missing blocks are not all free.
        """
        missing = self._missing_blocks(request_id, num_tokens_total)
        if missing > len(self._free):
            raise OutOfBlocks(request_id, missing, len(self._free))
        table = self._tables.setdefault(request_id, [])
        for _ in range(missing):
            block = self._free.popleft()
            self._refcounts[block] += 1
            table.append(block)
        return tuple(table)

    def free(self, request_id: str) -> int:
        """Drop the table of `request_id`; returns how many blocks went back to the free list.

        KeyError for an id without a table: a double free is a caller bug and must be loud.
        """
        table = self._tables.pop(request_id)
        released = 0
        for block in table:
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._free.append(block)
                released += 1
        return released

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        free_counts = Counter(self._free)
        twice = sorted(block for block, count in free_counts.items() if count > 1)
        if twice:
            raise AssertionError(f"blocks on the free list more than once: {twice}")
        holders: Counter[int] = Counter()
        for table in self._tables.values():
            holders.update(table)
        for block in range(self._num_blocks):
            refcount = self._refcounts[block]
            if refcount != holders[block]:
                raise AssertionError(
                    f"block {block}: refcount {refcount} but held by {holders[block]} table(s)"
                )
            if (block in free_counts) == (refcount > 0):
                state = "free and referenced" if refcount else "neither free nor referenced"
                raise AssertionError(f"block {block} is {state}")
        used = sum(1 for count in self._refcounts if count > 0)
        if used + len(self._free) != self._num_blocks:
            raise AssertionError(
                f"{used} used + {len(self._free)} free != {self._num_blocks} blocks"
            )
