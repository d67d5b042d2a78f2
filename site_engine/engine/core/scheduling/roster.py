"""The scheduler's state: every live sequence, waiting or running, the running ones' rows
(running_batch.py) and the KV blocks they hold, with the primitives that move a sequence
between those places whole.

A primitive keeps every index in step at once: a sequence admitted takes its blocks, its row,
its place in the running list, its class's count and its adapter's; preempted or retired, it
gives all of them back. The parts above (admission, the running rows' planner, the adapter gate,
result application) decide who moves; only the roster moves them. They hold the roster, never
its pieces, so a block manager swapped here (tests do, to record every call) is the one they all
use.

"static" is the batch-by-batch baseline: a batch is admitted only when none is running and runs
until its longest member is done; finished members stop computing but keep their blocks until
the batch ends (`held`), which is what a padded static batch costs in memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

import numpy as np

from fedllm_contract.priority import Priority
from site_engine.engine.core.block_manager import BlockManager, CacheHit
from site_engine.engine.core.class_preemption import pick_victim
from site_engine.engine.core.remaining import OUTRUN_SHARE
from site_engine.engine.core.running_batch import IntArray, RunningBatch
from site_engine.engine.core.scheduler_config import ClassLoad, SchedulerConfig, SchedulerStats
from site_engine.engine.core.sequence import Sequence, SequenceStatus
from site_engine.engine.core.sequence_cache import SequenceCache
from site_engine.engine.core.types import FinishReason
from site_engine.engine.core.unified_slots import UnifiedSlots, is_adapter_table
from site_engine.engine.core.waiting_queue import WaitingQueue

# Finishing for these reasons is the batch's own doing; a static batch keeps such a member's
# blocks. Cancelled or released members are gone for good and free theirs at once.
_NATURAL_FINISH = frozenset({FinishReason.STOP, FinishReason.LENGTH})


class Roster:
    """Who is live, waiting and running, in which row, holding which blocks."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(
            config.num_blocks,
            config.block_size,
            caching=config.prefix_caching,
            host_slots=config.host_kv_blocks,
            offload=config.host_offload,
        )
        self.static = config.policy == "static"
        self.live: dict[str, Sequence] = {}
        self.waiting = WaitingQueue(config.policy, config.spf_aging, config.spf_max_overtakes)
        # In admission order (a dict for O(1) removal): the last one is preempted first.
        self.running: dict[Sequence, None] = {}
        # The adapters of the running sequences, with how many of them use each.
        self.running_adapters: Counter[str] = Counter()
        # How many of `running` are of each class: whether a class has a victim below it is
        # asked every step, and walking 1,024 running sequences to find none cost the step.
        self.running_count = dict.fromkeys(Priority, 0)
        self.held: list[Sequence] = []  # static mode: finished members still holding blocks
        self.left_since_step: set[str] = set()
        # The running sequences' numbers, a row each (running_batch.py).
        self.batch = RunningBatch(config.max_num_seqs)
        # Preempted sequences with tokens of steps in flight, by the serial of the row they
        # left: result application still gives them those tokens.
        self.orphans: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.preemptions_by_class = dict.fromkeys(Priority, 0)
        self.cache = SequenceCache(self.blocks)
        # Adapter slots in the KV block pool (unified_slots.py), or None: max_loras fixed slots.
        self.slots = (
            UnifiedSlots(self.blocks, config.adapter_blocks, config.max_loras)
            if config.adapter_blocks
            else None
        )
        self._next_arrival = 0

    def enroll(self, seq: Sequence) -> None:
        """A new request joins the waiting queue; ValueError, nothing changed, if it can never
        be served."""
        self._check_admissible(seq)
        seq.arrival_index = self._next_arrival
        self._next_arrival += 1
        self.live[seq.request_id] = seq
        self.waiting.add(seq)

    def _check_admissible(self, seq: Sequence) -> None:
        rid, cfg = seq.request_id, self.config
        # A step still in flight may hold a row of an earlier request of this id: its late
        # results are told apart by the row's serial, not the id.
        if rid in self.live or rid in self.left_since_step or self.blocks.has_table(rid):
            raise ValueError(f"request {rid!r}: request_id is already in use")
        num_prompt, max_tokens = seq.num_prompt_tokens, seq.sampling.max_tokens
        if num_prompt > cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt has {num_prompt} tokens, "
                f"more than max_model_len={cfg.max_model_len}"
            )
        if num_prompt + max_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) "
                f"exceeds max_model_len={cfg.max_model_len}"
            )
        # The last sampled token is never fed back, so the KV peak is one slot short of the total.
        # A sequence whose peak exceeds the whole cache could be preempted forever, never finish.
        peak_blocks = self.blocks.blocks_needed(num_prompt + max_tokens - 1)
        if peak_blocks > cfg.num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) "
                f"needs up to {peak_blocks} KV blocks, the whole cache has {cfg.num_blocks}"
            )

    def admit(self, seq: Sequence, hit: CacheHit, num_tokens_total: int, onload: bool) -> int:
        """`seq`, the head of its class's admissions, starts running: its table made with the
        cache's `hit` and room for `num_tokens_total` slots, a row of the running batch taken;
        the row (the model runner hears of it with the next step)."""
        self.waiting.admitting(seq)
        self.blocks.admit(seq.request_id, hit, num_tokens_total, defer_onload=onload)
        batch = self.batch
        row = batch.attach(seq, self.config.max_model_len)
        batch.held[row] = self.blocks.num_held(seq.request_id)
        self.cache.admitted(seq, hit)
        seq.num_computed_tokens = hit.num_blocks * self.config.block_size
        seq.status = SequenceStatus.RUNNING
        seq.ever_scheduled = True
        seq.slot_wait_since = -1  # a preempted one counts its wait afresh
        self.running[seq] = None
        self.running_count[seq.priority] += 1
        if seq.adapter:
            self.running_adapters[seq.adapter] += 1
        return row

    def _stop_running(self, seq: Sequence) -> None:
        del self.running[seq]
        self.running_count[seq.priority] -= 1
        if seq.adapter:
            adapters = self.running_adapters
            adapters[seq.adapter] -= 1
            if not adapters[seq.adapter]:
                del adapters[seq.adapter]

    def victim(self, lowest: int) -> Sequence | None:
        """The running sequence to preempt first among those of class `lowest` or below: the
        lowest class, the newest of it."""
        return pick_victim(list(self.running), lowest)

    def runs_below(self, priority: Priority) -> bool:
        """Whether a sequence of a class below `priority` runs (one `victim` could take)."""
        return any(self.running_count[lower] for lower in Priority if lower > priority)

    def has_room(self, hit: CacheHit, num_tokens_total: int) -> bool:
        """A batch slot and the blocks for an admission's first chunk are free now."""
        return len(self.running) < self.config.max_num_seqs and self.blocks.can_admit(
            hit, num_tokens_total
        )

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: its blocks go back, it re-prefills prompt + generated tokens
        later, ahead of its class (admission_order puts preempted sequences first). A decode
        planned for it in the step being planned is the step plan's to take back first."""
        batch = self.batch
        serial = int(batch.serial[seq.row])
        self._stop_running(seq)
        self.blocks.free(seq.request_id)
        batch.detach(seq)
        if seq.num_pending:
            self.orphans[serial] = seq  # result application still gives it its tokens in flight
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_class[seq.priority] += 1
        self.waiting.add(seq)  # its key puts it ahead of its class's fresh ones

    def retire(self, seq: Sequence, reason: FinishReason) -> None:
        """`seq` leaves the engine for `reason`; its blocks are free at once (but a static
        batch's member that finished on its own, whose blocks the batch keeps)."""
        was_running = seq.status is SequenceStatus.RUNNING
        if was_running:
            self._stop_running(seq)
            self.batch.detach(seq)  # its tokens still in flight, if any, are no one's
        else:
            self.waiting.remove(seq)
        del self.live[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.ever_scheduled:
            # Only a sequence some step computed has state for the model runner to drop (its
            # sampler's), reported with the next step. One never scheduled (released for
            # offload, cancelled while queued) is forgotten now: its id is free at once, also
            # on an idle engine that schedules no step before it comes back (A -> B -> A).
            self.left_since_step.add(seq.request_id)
        if not was_running:
            return
        if self.static and reason in _NATURAL_FINISH:
            self.held.append(seq)
        else:
            self.blocks.free(seq.request_id)

    def end_static_batch_if_done(self) -> None:
        if self.running or not self.held:
            return
        for seq in self.held:
            self.blocks.free(seq.request_id)
        self.held.clear()

    def adapter_demand(self) -> Counter[str]:
        """Waiting requests by adapter (the eviction order's first key)."""
        return Counter(seq.adapter for seq in self.waiting if seq.adapter)

    def evict_idle_adapter(self, also_in_use: Collection[str]) -> bool:
        """Unified slots: an idle adapter (none running, none of `also_in_use`) gives its
        blocks back to the pool; whether one did."""
        slots = self.slots
        if slots is None:
            return False
        in_use = set(self.running_adapters) | set(also_in_use)
        return slots.evict_one(in_use, self.adapter_demand)

    def room_from_idle_adapters(self, seq: Sequence, hit: CacheHit, num_tokens_total: int) -> bool:
        """Idle adapters (not `seq`'s) evicted until `seq`'s first chunk has its blocks, before
        any sequence is preempted for them; whether it has room now. None is evicted if that
        would not make the room (no batch slot, or too few idle blocks): an adapter evicted
        for nothing would only be written again."""
        slots = self.slots
        if slots is None or len(self.running) >= self.config.max_num_seqs:
            return False
        mine = (seq.adapter,) if seq.adapter else ()
        idle = slots.idle_blocks(set(self.running_adapters) | set(mine))
        if self.blocks.admit_shortfall(hit, num_tokens_total) > idle:
            return False
        while not self.has_room(hit, num_tokens_total):
            if not self.evict_idle_adapter(mine):
                return False
        return True

    def stats(self, iterations: int) -> SchedulerStats:
        batch = self.batch
        rows = batch.rows()
        prio = batch.prio[rows]
        computed = batch.computed[rows]
        remaining = self._running_remaining(rows)
        held = sum(seq.num_computed_tokens for seq in self.held)
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            queued_prompt_tokens=self.waiting.tokens,
            predicted_remaining_tokens=self.waiting.remaining + int(remaining.sum()),
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            cached_tokens=int(computed.sum()) + held,
            iterations=iterations,
            num_preemptions=self.num_preemptions,
            kv_blocks_cached=self.blocks.num_cached_blocks,
            by_class=self._class_loads(prio, computed, remaining),
            **self.cache.counters,
        )

    def _running_remaining(self, rows: IntArray) -> IntArray:
        """Sequence.remaining_predicted_tokens of every running row at once (remaining.py)."""
        batch = self.batch
        prompt = batch.prompt_len[rows]
        produced = batch.tokens[rows] - prompt
        max_tokens = batch.max_tokens[rows]
        predicted = batch.expected_total[rows] - prompt
        allowed = np.maximum(max_tokens - produced, 0)
        ahead = predicted - produced
        outrun = np.maximum(np.ceil(OUTRUN_SHARE * produced).astype(np.int64), 1)
        return np.minimum(np.where(ahead >= 1, ahead, outrun), allowed)

    def _class_loads(
        self, prio: IntArray, computed: IntArray, remaining: IntArray
    ) -> tuple[ClassLoad, ...]:
        classes = len(Priority)
        running_tokens = np.bincount(prio, weights=computed, minlength=classes)
        running_remaining = np.bincount(prio, weights=remaining, minlength=classes)
        waiting = self.waiting
        return tuple(
            ClassLoad(
                p,
                waiting.count(p),
                self.running_count[p],
                self.preemptions_by_class[p],
                queued_prompt_tokens=waiting.tokens_of(p),
                running_tokens=int(running_tokens[p]),
                predicted_remaining_tokens=waiting.remaining_of(p) + int(running_remaining[p]),
            )
            for p in Priority
        )

    def check(self) -> None:
        """Raise AssertionError if queues, sequences and block tables disagree (used by tests)."""
        blocks, batch, running = self.blocks, self.batch, self.running
        blocks.check_invariants()
        batch.check()
        for seq in running:
            row = seq.row
            if row < 0 or batch.seqs[row] is not seq:
                raise AssertionError(f"running {seq.request_id!r} holds no row")
            if int(batch.held[row]) != blocks.num_held(seq.request_id):
                raise AssertionError(f"running {seq.request_id!r}: row's block count is stale")
        if batch.size != len(running):
            raise AssertionError("running batch size out of step with the running list")
        self.waiting.check()
        if Counter(seq.priority for seq in running) != +Counter(self.running_count):
            raise AssertionError(f"running counts {self.running_count} out of step")
        holders = {seq.request_id for seq in (*running, *self.held)}
        if self.slots is not None:
            self.slots.check()
        tables = {t for t in blocks.request_ids() if not is_adapter_table(t)}
        if holders != tables:
            raise AssertionError(
                f"tables {sorted(blocks.request_ids())} != holders {sorted(holders)}"
            )
        if len(running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(running)} running > max_num_seqs")
        self._check_sequences()

    def _check_sequences(self) -> None:
        size = self.config.block_size
        for seq in self.waiting:
            if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
                raise AssertionError(f"waiting {seq.request_id!r}: {seq.status}, computed>0")
        for seq in self.running:
            capacity = len(self.blocks.block_table(seq.request_id)) * size
            if not seq.num_computed_tokens < seq.num_tokens or seq.num_computed_tokens > capacity:
                raise AssertionError(f"running {seq.request_id!r}: bad computed/capacity")
        live = {seq.request_id for seq in (*self.waiting, *self.running)}
        if live != set(self.live):
            raise AssertionError("live index out of step with the queues")
        if self.blocks.caching:
            for seq in (*self.running, *self.held):
                self.cache.check(seq)
