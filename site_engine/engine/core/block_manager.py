"""Which physical KV blocks each sequence holds: block tables, a free queue, refcounts and, with
prefix caching, which blocks hold which block ids.

A sequence's memory grows with its real tokens: `grow` only allocates the blocks missing to cover
the requested number of token slots. Physical blocks come from the head of a free queue, so a
table is in general not contiguous; the model runner addresses the cache through the table.

Prefix caching (vLLM's automatic prefix caching; block ids from fedllm_contract/block_hash.py):
a full block whose tokens are known is indexed by its id (`register`; `register_all` for the
blocks that filled in a step, in one pass). When its last holder frees it, it keeps its
contents and its id and joins the free queue's tail, a table's last blocks first, so the queue's
head is the least recently used block and, of one request, its deepest block goes first (a
prefix outlives its extensions). Blocks that hold no id go to the
head: reusing them costs nothing. A block is evicted (its id forgotten) only when it is handed
out again. At admission `lookup` finds the longest chain of a prompt's ids that is held, and
`admit` shares those blocks by reference count.

With a host tier (site_engine/engine/core/host_tier.py) the chain goes on in host memory where the
device's ends: those blocks get fresh device blocks and a copy back before the step runs. Of the
blocks near the head of the free queue, those likely to be read again are copied to the host
ahead of their eviction (`offload_ahead`), within a per-step budget (site_engine/engine/
host_offload.py decides which); the copies overlap the steps, and a step that overwrites such a
block waits for its copy only if that copy may still be running (`take_copies` names the step
whose copies it must wait for). A block reaching eviction without a copy is simply evicted: no
copy ever sits on a step's critical path. Every copy is listed (`take_copies`) for the model
runner.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fedllm_contract.cache_events import CacheEvent, Tier
from site_engine.engine.core.host_offload import OffloadCounters, OffloadLimits, OffloadPolicy
from site_engine.engine.core.host_tier import HostTier
from site_engine.engine.core.prefix_cache import BlockIndex, CacheEventRecorder, snapshot_events
from site_engine.engine.core.types import KvCopy


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for a `grow`; the manager's state is unchanged."""

    def __init__(self, request_id: str, needed: int, free: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {needed} more KV block(s), only {free} free"
        )
        self.request_id = request_id
        self.needed = needed
        self.free = free


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The leading blocks of a prompt found cached: on the device, then in the host tier."""

    device_blocks: tuple[int, ...] = ()
    host_slots: tuple[int, ...] = ()
    # The ids of those blocks, device ones first.
    hashes: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


NO_HIT = CacheHit()


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """A step's host-tier copies in the order they must run; the step's forward pass waits for
    the first `before_step` (copies back from the host) and, if `wait_for_step` > 0, for the
    ahead-of-eviction copies listed by that step: one of those blocks is overwritten now."""

    copies: tuple[KvCopy, ...] = ()
    before_step: int = 0
    wait_for_step: int = 0


class BlockManager:
    """Fixed-size KV blocks handed out to per-sequence block tables."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        caching: bool = False,
        host_slots: int = 0,
        offload: OffloadLimits | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if host_slots and not caching:
            raise ValueError("a host tier needs prefix caching")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refcounts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self.events = CacheEventRecorder()
        self._index = BlockIndex(Tier.DEVICE, self.events, num_blocks) if caching else None
        # Device block -> its id (None: none), read without a call for every block freed or
        # handed out; all None without caching.
        self._indexed: Sequence[int | None] = [None] * num_blocks
        if self._index is not None:
            self._indexed = self._index.ids_at
        self._host = HostTier(host_slots, self.events) if host_slots else None
        self._policy = OffloadPolicy(offload) if host_slots else None
        # Device block -> the step whose copies took it to the host ahead of its eviction;
        # dropped when the block is handed out (that step's copies then bind the one taking it).
        self._offloaded_at: dict[int, int] = {}
        self._wait_for_step = 0
        # Device blocks being copied back from the host for a sequence that runs from the
        # next step on (`admit(defer_onload=True)`): this step's forward pass does not wait.
        self._loading: set[int] = set()
        # Per table: how many leading blocks `register` has seen (indexed, or left as duplicates).
        self._registered: dict[str, int] = {}
        self._copies: list[KvCopy] = []
        self._copies_before_step = 0
        # The top of the cache lent to a neighbour instance on this GPU (idle memory first,
        # site_engine/engine/core/kv_lending.py): blocks neither free nor held by any table.
        self._lent: list[int] = []
        # Blocks from this index up are being drained for a lending (drain_tail): freed ones
        # stay out of the free queue until the tail can be lent whole.
        self._drain_from = num_blocks
        self._drained: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def caching(self) -> bool:
        return self._index is not None

    @property
    def host_slots(self) -> int:
        return self._host.num_slots if self._host is not None else 0

    @property
    def offload_counters(self) -> OffloadCounters:
        """The host tier's offload decisions since start (all zero without a host tier)."""
        return self._policy.counters if self._policy is not None else OffloadCounters()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds, cached ones included (they are evicted when handed out)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Device blocks indexed by an id, held or free."""
        return len(self._index) if self._index is not None else 0

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

    def table_if_held(self, request_id: str) -> tuple[int, ...]:
        """block_table(request_id), or () once it holds none (left since)."""
        table = self._tables.get(request_id)
        return () if table is None else tuple(table)

    def num_held(self, request_id: str) -> int:
        """len(block_table(request_id)) without copying the table (the admission plan asks it
        of every running sequence)."""
        return len(self._tables[request_id])

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def cached_hash(self, block: int) -> int | None:
        """The id `block` is indexed by on the device, if any."""
        return self._index.hash_at(block) if self._index is not None else None

    # ---- allocation ------------------------------------------------------------------------
    def _missing_blocks(self, request_id: str, num_tokens_total: int) -> int:
        held = len(self._tables.get(request_id, ()))
        if held * self._block_size >= num_tokens_total >= 0:
            return 0  # the common decode step: the last block still has room
        return max(self.blocks_needed(num_tokens_total) - held, 0)

    def can_grow(self, request_id: str, num_tokens_total: int) -> bool:
        """Whether `grow(request_id, num_tokens_total)` would succeed now."""
        return self._missing_blocks(request_id, num_tokens_total) <= len(self._free)

    def try_grow(self, request_id: str, num_tokens_total: int) -> bool:
        """`grow` if `can_grow`, in one call and without copying the table; whether it did.
        A decode step of 1,024 sequences asks this of each, and most need no new block."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self._block_size >= num_tokens_total >= 0:
            return True
        if not self.can_grow(request_id, num_tokens_total):
            return False
        self.grow(request_id, num_tokens_total)
        return True

    def grow_by_one(self, request_ids: Sequence[str]) -> list[int]:
        """One more block at the end of each named table, in order, while free blocks last:
        the decode rows of a step whose next token starts a block (a 1,024-sequence step has
        ~64 of them). The blocks given, one per table from the first (fewer if blocks ran out:
        the caller makes room for the rest one at a time)."""
        given: list[int] = []
        free, tables, take = self._free, self._tables, self._take_free_block
        for request_id in request_ids:
            if not free:
                break
            block = take()
            tables[request_id].append(block)
            given.append(block)
        return given

    def grow(self, request_id: str, num_tokens_total: int) -> tuple[int, ...]:
        """Make the table of `request_id` cover `num_tokens_total` token slots.

        Creates the table on first use (an empty one for 0 tokens) and never shrinks it. Raises
        OutOfBlocks, with nothing allocated, if the missing blocks are not all free.
        """
        missing = self._missing_blocks(request_id, num_tokens_total)
        if missing > len(self._free):
            raise OutOfBlocks(request_id, missing, len(self._free))
        table = self._tables.setdefault(request_id, [])
        self._registered.setdefault(request_id, 0)
        for _ in range(missing):
            table.append(self._take_free_block())
        return tuple(table)

    def _take_free_block(self) -> int:
        """The head of the free queue, its id evicted. Never copied now: a copy the step had to
        wait for is what cost the host tier its TTFT; one that `offload_ahead` did not make
        (not wanted, or over budget) is simply not made."""
        block, _ = self._free.popitem(last=False)
        self._refcounts[block] += 1
        if self._offloaded_at:
            offloaded_at = self._offloaded_at.pop(block, 0)
            self._wait_for_step = max(self._wait_for_step, offloaded_at)
        if self._loading and block in self._loading:
            # Its copy back (for a sequence preempted since) must land before this step
            # overwrites it: the step waits for the copies listed so far.
            self._copies_before_step = len(self._copies)
        block_hash = self._indexed[block]
        if block_hash is not None:
            assert self._index is not None
            if self._policy is not None and self._host is not None and block_hash not in self._host:
                self._policy.evicted_uncopied(block_hash, self._index.hits_of(block_hash))
            self._index.remove_at(block)
        return block

    def free(self, request_id: str) -> int:
        """Drop the table of `request_id`; returns how many blocks went back to the free queue.

        KeyError for an id without a table: a double free is a caller bug and must be loud.
        """
        table = self._tables.pop(request_id)
        registered = self._registered.pop(request_id)
        if self._policy is not None and self._index is not None:
            hash_at = self._index.hash_at
            # Its conversation is active: the next turn's prompt starts with these blocks.
            self._policy.left(h for b in table[:registered] if (h := hash_at(b)) is not None)
        released = 0
        refcounts, free_queue, indexed = self._refcounts, self._free, self._indexed
        caching = self._index is not None
        # Last blocks first: of one request's cached blocks, the deepest is evicted first.
        drain_from = self._drain_from
        for block in reversed(table) if caching else table:
            refcounts[block] -= 1
            if refcounts[block] == 0:
                if block >= drain_from:
                    self._hold_for_lending(block)
                    released += 1
                    continue
                free_queue[block] = None
                if caching and indexed[block] is None:
                    free_queue.move_to_end(block, last=False)
                released += 1
        return released

    # ---- prefix caching --------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> CacheHit:
        """The longest run of `hashes` (a prompt's leading block ids, in order) held in the
        device cache, continued in the host tier. Changes nothing."""
        if self._index is None:
            return NO_HIT
        device = self._index.leading_places(hashes)
        slots: list[int] = []
        if self._host is not None:
            for block_hash in hashes[len(device) :]:
                slot = self._host.find(block_hash)
                if slot is None:
                    break
                slots.append(slot)
        return CacheHit(tuple(device), tuple(slots), tuple(hashes[: len(device) + len(slots)]))

    def shared_in_use(self, hit: CacheHit) -> int:
        """Blocks of `hit` that running sequences already hold (they cost no new memory)."""
        return sum(1 for block in hit.device_blocks if self._refcounts[block] > 0)

    def can_admit(self, hit: CacheHit, num_tokens_total: int) -> bool:
        """Whether `admit(_, hit, num_tokens_total)` would succeed now."""
        return self.admit_shortfall(hit, num_tokens_total) == 0

    def admit_shortfall(self, hit: CacheHit, num_tokens_total: int) -> int:
        """How many more free blocks `admit(_, hit, num_tokens_total)` needs (0: it fits)."""
        idle_hits = len(hit.device_blocks) - self.shared_in_use(hit)
        fresh = max(self.blocks_needed(num_tokens_total) - len(hit.device_blocks), 0)
        return max(fresh - (len(self._free) - idle_hits), 0)

    def admit(
        self, request_id: str, hit: CacheHit, num_tokens_total: int, *, defer_onload: bool = False
    ) -> tuple[int, ...]:
        """Start the table of `request_id` with the blocks of `hit` (shared; host ones copied
        into fresh blocks) and grow it to `num_tokens_total` slots. With `defer_onload` the
        copies back from the host overlap this step (the caller schedules none of the sequence's
        tokens in it) and bind the next one."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds a table")
        if not self.can_admit(hit, num_tokens_total):
            raise OutOfBlocks(request_id, self.blocks_needed(num_tokens_total), len(self._free))
        if self._loading and not self._loading.isdisjoint(hit.device_blocks):
            # It shares blocks still being copied back, and may run in this step: this step's
            # forward pass waits for those copies after all.
            self._copies_before_step = len(self._copies)
        table: list[int] = []
        for block, block_hash in zip(hit.device_blocks, hit.hashes, strict=False):
            if self._refcounts[block] == 0:
                del self._free[block]
            self._refcounts[block] += 1
            table.append(block)
            if self._policy is not None:
                assert self._index is not None
                self._index.record_hit(block_hash)
        if hit.host_slots:
            assert self._index is not None
            assert self._host is not None
            self._host.pin(hit.host_slots)  # evictions below must not reuse a slot we read
            for i, slot in enumerate(hit.host_slots, start=len(hit.device_blocks)):
                block = self._take_free_block()
                parent = hit.hashes[i - 1] if i else 0
                # Left unindexed if a later block of the chain is on the device after all.
                self._index.add(hit.hashes[i], parent, block)
                self._index.record_hit(hit.hashes[i])
                self._host.touch(slot)
                self._copies.append(KvCopy(to_host=False, block=block, slot=slot))
                if defer_onload:
                    self._loading.add(block)
                else:
                    self._copies_before_step = len(self._copies)
                table.append(block)
            self._host.unpin()
        self._tables[request_id] = table
        self._registered[request_id] = hit.num_blocks
        return self.grow(request_id, num_tokens_total)

    def register(self, request_id: str, hashes: Sequence[int], num_full: int) -> None:
        """Index the first `num_full` blocks of the table by `hashes` (the sequence's block ids):
        their KV is written, or being written by a scheduled step, and their tokens are known."""
        self.register_all([(request_id, hashes, num_full)])

    def register_all(self, registrations: Iterable[tuple[str, Sequence[int], int]]) -> None:
        """`register` of each (request id, hashes, num_full) in order, with one pass over the
        index: the sequences whose blocks filled in one step."""
        index = self._index
        if index is None:
            return
        registered, tables = self._registered, self._tables
        entries: list[tuple[int, int, int]] = []
        append = entries.append
        for request_id, hashes, num_full in registrations:
            done = registered[request_id]
            if num_full <= done:
                continue
            table = tables[request_id]
            for i in range(done, num_full):
                append((hashes[i], hashes[i - 1] if i else 0, table[i]))
            registered[request_id] = num_full
        index.add_all(entries)

    def offload_ahead(self, lookahead: int, step_id: int = 0) -> None:
        """Copy to the host tier the wanted cached blocks among the next `lookahead` blocks to
        be handed out, head first, within the step's budget; the copies are listed by step
        `step_id`."""
        host, index, policy = self._host, self._index, self._policy
        if host is None or index is None or policy is None:
            return
        for n, block in enumerate(self._free):
            if n >= lookahead or not policy.budget_left:
                break
            block_hash = index.hash_at(block)
            if block_hash is None or block_hash in host:
                continue
            if not policy.wanted(block_hash, index.hits_of(block_hash)):
                continue
            slot = host.store(block_hash, index.parent_of(block_hash))
            if slot is None:
                break
            policy.take()
            self._copies.append(KvCopy(to_host=True, block=block, slot=slot))
            self._offloaded_at[block] = step_id

    def take_copies(self, step_id: int = 0) -> CopyPlan:
        """The copies decided since the last call, listed by step `step_id`, and what its
        forward pass must wait for; the offload budget starts over. Copies back from the host
        deferred to the next step make that step wait for this one's copies."""
        plan = CopyPlan(tuple(self._copies), self._copies_before_step, self._wait_for_step)
        self._copies.clear()
        self._copies_before_step = 0
        self._wait_for_step = step_id if self._loading else 0
        self._loading.clear()
        if self._policy is not None:
            self._policy.step()
        return plan

    def snapshot_events(self) -> list[CacheEvent]:
        """BlocksStored events listing every block id held, device tier first."""
        indexes = [index for index in (self._index, self._host and self._host.index) if index]
        return snapshot_events(indexes)

    @property
    def num_lent_blocks(self) -> int:
        return len(self._lent)

    def free_tail_blocks(self) -> int:
        """How many blocks `lend_tail` could take now (the free run down from the top, below
        what is already lent); changes nothing."""
        top = self._num_blocks - len(self._lent) - 1
        count = 0
        while self._lendable(top - count):
            count += 1
        return count

    def _lendable(self, block: int) -> bool:
        return block >= 0 and self._refcounts[block] == 0 and block not in self._loading

    def lend_tail(self, count: int) -> int:
        """Takes up to `count` blocks off the top of the cache (the highest indices, contiguous
        down from the top or from what is already lent), each only if no table holds it: a
        running sequence's block is never lent, so the tail stops at the highest held one.
        Cached ids of the blocks taken are forgotten (as on a block handed out). Returns how
        many were lent; the scheduler sees as many fewer free blocks."""
        lent = 0
        top = self._num_blocks - len(self._lent) - 1
        while lent < count and self._lendable(top):
            if top in self._drained:
                self._drained.discard(top)
            else:
                self._take_for_lending(top)
            self._lent.append(top)
            lent += 1
            top -= 1
        return lent

    def _take_for_lending(self, block: int) -> None:
        """A free block out of the free queue, its cached id forgotten."""
        del self._free[block]
        if self._index is not None and self._indexed[block] is not None:
            self._index.remove_at(block)
        self._offloaded_at.pop(block, None)

    def _hold_for_lending(self, block: int) -> None:
        """A block freed inside the drained tail: kept apart, its cached id forgotten."""
        if self._index is not None and self._indexed[block] is not None:
            self._index.remove_at(block)
        self._offloaded_at.pop(block, None)
        self._drained.add(block)

    @property
    def draining(self) -> bool:
        return self._drain_from < self._num_blocks

    def drain_tail(self, count: int) -> int:
        """Prepares lending the top `count` blocks (below what is lent) when running sequences
        hold some of them: the free ones leave the free queue now, the held ones as their
        sequences free them, so no new sequence takes a block of that tail (on a cache whose
        free queue has cycled through every block, the top is rarely free all at once). The
        scheduler sees the drained blocks as not free. Returns how many of the tail are still
        held; `lend_tail(count)` succeeds once that is 0. `end_drain` gives the free ones back."""
        if count < 1:
            raise ValueError(f"a drain needs at least one block, not {count}")
        top = self._num_blocks - len(self._lent)
        start = max(0, top - count)
        if self.draining:
            if start != self._drain_from:
                raise ValueError("a drain of another length is under way")
            # Asked again between steps while it drains: `free` kept the count, no scan.
            return top - start - len(self._drained)
        self._drain_from = start
        held = 0
        for block in range(start, top):
            if block in self._free:  # one still loading is lent once its copy lands
                self._take_for_lending(block)
                self._drained.add(block)
            else:
                held += 1
        return held

    def end_drain(self) -> int:
        """Stops draining (the tail was lent, or is no longer wanted): drained blocks not lent
        go back to the free queue (at its end: handed out last); how many."""
        back = len(self._drained)
        for block in sorted(self._drained):
            self._free[block] = None
        self._drained.clear()
        self._drain_from = self._num_blocks
        return back

    def return_lent(self) -> int:
        """The lent tail back to the free queue (at its end: handed out last), or to the drain
        it was lent from while that is under way; how many."""
        returned = len(self._lent)
        for block in self._lent:
            if block >= self._drain_from:  # a lending short of a drained tail: still drained
                self._drained.add(block)
            else:
                self._free[block] = None
        self._lent.clear()
        return returned

    def clear_cache(self) -> None:
        """Forget every id of every tier (blocks keep their holders); one AllBlocksCleared event."""
        if self._index is None:
            return
        self._index.clear()
        if self._host is not None:
            self._host.clear()
        self.events.cleared()

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        holders: Counter[int] = Counter()
        for table in self._tables.values():
            holders.update(table)
        for block in range(self._num_blocks):
            refcount = self._refcounts[block]
            if refcount != holders[block]:
                raise AssertionError(
                    f"block {block}: refcount {refcount} but held by {holders[block]} table(s)"
                )
            if block in self._lent or block in self._drained:
                if refcount or block in self._free:
                    raise AssertionError(f"lent or drained block {block} is also free or held")
                if block in self._drained and block < self._drain_from:
                    raise AssertionError(f"drained block {block} below the drain")
                continue
            if (block in self._free) == (refcount > 0):
                state = "free and referenced" if refcount else "neither free nor referenced"
                raise AssertionError(f"block {block} is {state}")
        if set(self._registered) != set(self._tables):
            raise AssertionError("registration counts out of step with the tables")
        for request_id, table in self._tables.items():
            if self._registered[request_id] > len(table):
                raise AssertionError(f"{request_id!r}: more blocks registered than held")
        if self._host is not None:
            self._host.check_invariants()
