"""How the scheduler uses the prefix cache for its sequences: the lookup at admission, indexing
full blocks once their KV is launched, the host tier's copies, and the counters it reports.

The rules (site_engine/engine/core/scheduling/admission.py and results.py say why): a hit never
covers a sequence's last token; only full blocks of known tokens whose KV a launched step writes
are indexed. Pure Python.
"""

from __future__ import annotations

from fedllm_contract.block_hash import chains_block_hashes
from site_engine.engine.core.block_manager import NO_HIT, BlockManager, CacheHit, CopyPlan
from site_engine.engine.core.sequence import Sequence

# SchedulerStats' cumulative counters (site_engine/engine/core/scheduler_config.py), by name.
COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_host_hits",
    "prompt_tokens_computed",
    "host_kv_blocks_offloaded",
    "host_kv_blocks_onloaded",
    "host_kv_blocks_skipped_budget",
    "host_kv_blocks_declined",
)


class SequenceCache:
    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks
        self._size = blocks.block_size
        self._caching = blocks.caching  # fixed for the manager's life; read per filled block
        self.counters = dict.fromkeys(COUNTERS, 0)

    def lookup(self, seq: Sequence) -> CacheHit:
        """The cached leading blocks of a waiting sequence (no pending tokens), short of its
        last token, which is always computed for its logits."""
        if not self._caching:
            return NO_HIT
        num_blocks = (seq.num_tokens - 1) // self._size
        hashes = seq.full_block_hashes(self._size, num_blocks)
        return self._blocks.lookup(hashes[:num_blocks])

    def admitted(self, seq: Sequence, hit: CacheHit) -> None:
        """Count an admission's lookup (vLLM's queries and hits, in tokens)."""
        if not self._caching:
            return
        cached = hit.num_blocks * self._size
        self.counters["prefix_cache_queries"] += seq.num_tokens
        self.counters["prefix_cache_hits"] += cached
        self.counters["prefix_cache_host_hits"] += len(hit.host_slots) * self._size
        if not seq.ever_scheduled:
            seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
        # Its table starts with the hit's blocks registered: the next to index is the one after.
        seq.next_full_block_at = (hit.num_blocks + 1) * self._size

    def computed(self, seq: Sequence, start: int, end: int) -> None:
        """Positions [start, end) of `seq` are scheduled: count the prompt ones."""
        if start < seq.num_prompt_tokens:
            self.counters["prompt_tokens_computed"] += min(end, seq.num_prompt_tokens) - start

    def full_blocks(self, seq: Sequence) -> int:
        """How many leading blocks of running `seq` are full of known tokens whose KV a launched
        step writes (what `register_all` may index); no block can become indexable before its
        computed tokens fill the next one, which `seq.next_full_block_at` is set to."""
        known = seq.num_known_tokens
        computed = seq.num_computed_tokens
        num_full = (computed if computed < known else known) // self._size
        seq.next_full_block_at = (num_full + 1) * self._size
        return num_full

    def register_all(self, filled: list[tuple[Sequence, int]]) -> None:
        """Index the first `num_full` blocks of each (sequence, num_full) of `filled` (running
        sequences whose KV is launched and whose tokens are known: `full_blocks`, or the same
        computed for many rows at once), in order; hashes only the blocks that filled since the
        last call, all of them in one pass (chains_block_hashes)."""
        if not self._caching:
            return
        size = self._size
        tokens: list[int] = []
        chains: list[tuple[int, int]] = []
        extended: list[list[int]] = []  # the hash lists `chains` extend, in order
        registrations: list[tuple[str, list[int], int]] = []
        for seq, num_full in filled:
            hashes = seq.block_hashes
            done = len(hashes)
            if num_full > done:
                start, end = done * size, num_full * size
                num_prompt = len(seq.prompt_token_ids)
                if start >= num_prompt:  # answer tokens, all known: no copy of the rest
                    tokens += seq.output_token_ids[start - num_prompt : end - num_prompt]
                else:
                    tokens += seq.token_ids_between(start, end)
                chains.append((hashes[-1] if done else seq.root_hash, num_full - done))
                extended.append(hashes)
            registrations.append((seq.request_id, hashes, num_full))
        if chains:
            ids = chains_block_hashes(tokens, size, chains)
            at = 0
            for hashes, (_, count) in zip(extended, chains, strict=True):
                if count == 1:
                    hashes.append(ids[at])
                else:
                    hashes += ids[at : at + count]
                at += count
        self._blocks.register_all(registrations)

    def take_copies(self, lookahead: int, step_id: int) -> CopyPlan:
        """Step `step_id`'s host-tier copies, those ahead of eviction (among the next
        `lookahead` blocks to be handed out) included."""
        if not self._blocks.host_slots:
            return self._blocks.take_copies(step_id)
        self._blocks.offload_ahead(lookahead, step_id)
        plan = self._blocks.take_copies(step_id)
        onloaded = sum(1 for copy in plan.copies if not copy.to_host)
        counters, decided = self.counters, self._blocks.offload_counters
        counters["host_kv_blocks_onloaded"] += onloaded
        counters["host_kv_blocks_offloaded"] += len(plan.copies) - onloaded
        counters["host_kv_blocks_skipped_budget"] = decided.skipped_budget
        counters["host_kv_blocks_declined"] = decided.declined
        return plan

    def check(self, seq: Sequence) -> None:
        """Raise AssertionError unless a block held by several sequences is a full block of
        computed, known tokens of each, and an indexed block of `seq` holds `seq`'s own id."""
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self._size
        hashes = seq.full_block_hashes(self._size, num_full)
        for i, block in enumerate(self._blocks.block_table(seq.request_id)):
            indexed = self._blocks.cached_hash(block)
            if self._blocks.refcount(block) > 1 and i >= num_full:
                raise AssertionError(f"{seq.request_id!r}: shares block {i}, not full yet")
            if indexed is not None and (i >= num_full or indexed != hashes[i]):
                raise AssertionError(f"{seq.request_id!r}: block {i} is indexed by another id")
