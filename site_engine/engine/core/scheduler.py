"""Iteration-level (continuous batching) scheduler with MICO's prediction-aware admission.

Each step: running sequences first (one decode token each, or their next prefill chunk), then
waiting ones are admitted in policy order while the sequence limit, the per-step token budget
and the KV budget allow. A finished sequence is retired in the same `update` and its blocks
return at once, so a waiting one can start at the very next step.

Admission (adaptive batch size): a candidate is admitted only if, planning every running
sequence at its expected total length (prompt + predicted output, or + max_tokens without a
prediction; never less than what it holds now) plus the candidate at its expected total, the
plan fits in the cache minus a watermark. Blocks are allocated only for tokens actually computed,
so a good prediction admits more sequences than max_tokens would, and a bad one is corrected by
recompute preemption: the most recently admitted running sequence gives its blocks back and
re-prefills prompt + generated tokens later. When nothing runs, the head of the queue is admitted
regardless of the plan, which (with the size check in `add`) guarantees progress.

Async scheduling: a step's chunks count as computed as soon as they are scheduled and its
sampled tokens as pending, so the next step can be scheduled while this one still runs on the
device (the runner feeds pending tokens from the device). `update` must then be applied to the
steps in the order they were scheduled; it resolves pending tokens and retires finished
sequences. A sequence that finishes on EOS therefore computes one extra token that is thrown
away; one that reaches max_tokens is never scheduled past it. Called strictly as
schedule -> update -> schedule, nothing is ever pending when a step is scheduled.

Prefix caching (config.prefix_caching): at admission the longest chain of the sequence's full
blocks held in the cache (site_engine/engine/core/block_manager.py) is shared instead of computed,
never the whole sequence: its last token is always computed, for its logits (vLLM caps a hit at
num_tokens - 1 the same way). Only the uncached tokens count against the step's token budget, and
the admission plan counts a block that running sequences already hold once. Full blocks are
indexed by `update` once the step that writes their KV is launched and their tokens are known
(a generated block's last token may still be on the device when its KV is scheduled, with async
scheduling). A block indexed while that step still runs on the device is safe to share: every
later step is queued behind it.

Priority classes (fedllm_contract/priority.py: interactive > flex > batch): a step is planned
class by class from the top, each class's running sequences and then its admissions, so a higher
class takes the step's token budget first. A class's admission plan counts the holders of its
class and higher ones only; when it needs a batch slot or blocks now, it preempts running
sequences of lower classes (class_preemption.py), never of its own or a higher one, which it
waits for. KV growth preempts the lowest class first, `seq` itself before any higher one. The
background classes' prefill per step is bounded (step_budget.py, the deferral bound).

LoRA adapters: the running sequences use at most max_loras distinct adapters. A waiting request
whose adapter has no slot is passed over like one whose grammar compiles, but for at most
adapter_overtake_steps steps: then one running adapter drains for it (adapter_slots.py), that
adapter's requests behind it in order waiting so that its slot frees, while the other adapters'
and base requests go on. With config.adapter_blocks > 0 the slots come out of the KV block pool
(unified_slots.py): an adapter is made resident when a request of it is admitted or waits near
the head (prefetch), idle adapters give their blocks back before any sequence is preempted or
refused for blocks, and max_loras only caps how many are resident.

Host work per step (issue 66): a running sequence's numbers live in a row of the running batch
(running_batch.py), so the common step, every decoding sequence one more token, is planned and
applied with array operations over the rows: decodes are planned in bulk for each class before
its prefill chunks (a long prefill cannot starve the decodes of its class of the step's token
budget), a new block is Python only for the rows that cross a block boundary, the update appends
the sampled tokens and finds the finished rows with vectorized checks, and Python runs per row
only for what changed: admissions, prefill chunks, finishes, preemptions, grammars. The model
runner is told the step as deltas (SchedulerOutput: rows that joined, blocks added to tables,
decode rows as arrays).

"static" is the batch-by-batch baseline: a batch is admitted only when none is running and runs
until its longest member is done; finished members stop computing but keep their blocks until
the batch ends, which is what a padded static batch costs in memory.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Collection, Iterable
from itertools import islice

import numpy as np

from fedllm_contract.block_hash import root_hash
from fedllm_contract.cache_events import CacheEvent
from fedllm_contract.priority import Priority
from site_engine.engine.core.adapter_slots import adapter_to_drain, outranked
from site_engine.engine.core.block_manager import BlockManager, CacheHit
from site_engine.engine.core.class_preemption import pick_victim, room_without
from site_engine.engine.core.outputs import NO_TOKEN, StepOutputs
from site_engine.engine.core.remaining import OUTRUN_SHARE
from site_engine.engine.core.running_batch import IntArray, RunningBatch
from site_engine.engine.core.scheduler_config import ClassLoad, SchedulerConfig, SchedulerStats
from site_engine.engine.core.sequence import Sequence, SequenceStatus
from site_engine.engine.core.sequence_cache import SequenceCache
from site_engine.engine.core.step_budget import StepBudget
from site_engine.engine.core.step_cost import StepCost, StepCostModel
from site_engine.engine.core.types import (
    FinishReason,
    Guide,
    ModelRunnerOutput,
    RowJoin,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from site_engine.engine.core.unified_slots import UnifiedSlots, is_adapter_table
from site_engine.engine.core.waiting_queue import WaitingQueue

__all__ = ["ClassLoad", "Scheduler", "SchedulerConfig", "SchedulerStats"]
_NO_DELTA = (np.zeros(0, dtype=np.int64),) * 3
# A chunk's planning key: its class, then its admission order (SchedulerOutput.chunks sorts by it).
_CLASS_KEY = 1 << 48
log = logging.getLogger(__name__)

# Finishing for these reasons is the batch's own doing; a static batch keeps such a member's
# blocks. Cancelled or released members are gone for good and free theirs at once.
_NATURAL_FINISH = frozenset({FinishReason.STOP, FinishReason.LENGTH})


class Scheduler:
    """Decides each step's batch and keeps every sequence's KV blocks in step with it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._blocks = BlockManager(
            config.num_blocks,
            config.block_size,
            caching=config.prefix_caching,
            host_slots=config.host_kv_blocks,
            offload=config.host_offload,
        )
        self._static = config.policy == "static"
        self._live: dict[str, Sequence] = {}
        self._waiting = WaitingQueue(config.policy, config.spf_aging, config.spf_max_overtakes)
        # In admission order (a dict for O(1) removal): the last one is preempted first.
        self._running: dict[Sequence, None] = {}
        # The adapters of the running sequences, with how many of them use each.
        self._running_adapters: Counter[str] = Counter()
        # How many of `_running` are of each class: whether a class has a victim below it is
        # asked every step, and walking 1,024 running sequences to find none cost the step.
        self._running_count = dict.fromkeys(Priority, 0)
        self._held: list[Sequence] = []  # static mode: finished members still holding blocks
        self._left_since_step: set[str] = set()
        # The running sequences' numbers, a row each (running_batch.py).
        self._batch = RunningBatch(config.max_num_seqs)
        self._eos = np.array(sorted(config.eos_token_ids), dtype=np.int64)
        # The steps scheduled and not yet updated, oldest first (results come back in order; a
        # row's serial, not its request id, tells a late result from a new occupant's).
        self._in_flight: dict[int, None] = {}
        # Rows given a decode in the step being planned; rows taken and tables grown since the
        # last step (what the model runner is told: SchedulerOutput.joined, table_delta).
        self._decoding = np.zeros(config.max_num_seqs, dtype=np.bool_)
        self._joined: list[RowJoin] = []
        self._grown: set[int] = set()
        # Blocks added in bulk since the last step: (rows, positions in their tables, blocks).
        self._table_parts: list[tuple[IntArray, IntArray, IntArray]] = []
        self._budget: StepBudget | None = None  # the step's, while it is planned
        # Preempted sequences with tokens of steps in flight, by the serial of the row they
        # left: `update` still gives them those tokens.
        self._orphans: dict[int, Sequence] = {}
        # The sequences given a chunk that samples nothing (a prefill chunk short of the end)
        # in the step being planned, and those of each step in flight: `update` registers their
        # filled blocks without a pass over every chunk of the step.
        self._unsampled: list[str] = []
        self._unsampled_by_step: dict[int, list[str]] = {}
        # advance_guides' verdicts (step id, request id -> finish reason), taken by `update`.
        self._guided: tuple[int, dict[str, FinishReason | None]] | None = None
        self._next_step_id = 1
        self._next_arrival = 0
        self._iterations = 0
        self._num_preemptions = 0
        self._preemptions_by_class = dict.fromkeys(Priority, 0)
        self._cache = SequenceCache(self._blocks)
        self._step_cost = StepCostModel()
        # The running adapter being drained for a waiting request that has no adapter slot
        # (adapter_slots.py), kept across steps while it runs; `_hold` is it in the step being
        # planned once such a request was met (None before: nobody is held back yet).
        self._drain: str | None = None
        self._hold: str | None = None
        # Adapter slots in the KV block pool (unified_slots.py), or None: max_loras fixed slots.
        self._slots = (
            UnifiedSlots(self._blocks, config.adapter_blocks, config.max_loras)
            if config.adapter_blocks
            else None
        )

    @property
    def block_manager(self) -> BlockManager:
        """The cache's bookkeeping (the idle-memory lending works on it: core/kv_lending.py)."""
        return self._blocks

    @property
    def step_cost(self) -> StepCost | None:
        """The step cost learned so far (None until enough steps were reported)."""
        return self._step_cost.current

    def observe_step(self, tokens: int, context: int, seconds: float) -> None:
        """A step that computed `tokens` positions reading `context` took `seconds` (measured by
        the engine's owner): what the time side of the deferral bound learns from."""
        self._step_cost.observe(tokens, context, seconds)

    def add(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling: SamplingParams,
        predicted_tokens: int | None = None,
        cache_salt: str = "",
        guide: Guide | None = None,
        releasable: bool = True,
        awaiting_guide: bool = False,
        priority: Priority = Priority.INTERACTIVE,
        adapter: str = "",
        awaiting_adapter: bool = False,
    ) -> Sequence:
        """Queue a request; ValueError (and no state change) if it can never be served.
        `cache_salt` keeps its cached blocks apart from those of other salts; `guide`: the
        grammar its answer must follow (advanced here, in `update`), or `awaiting_guide` while
        that grammar is being compiled (the request waits, and others are admitted before it,
        until `set_guide`); `releasable` False keeps it out of release_queued (one choice of
        several: they leave together); `priority` its class (interactive, flex, batch);
        `adapter`: its LoRA adapter ("": none), a key of its block ids, `awaiting_adapter` while
        that adapter loads (it waits until `adapter_loaded`)."""
        seq = Sequence(request_id, tuple(prompt_token_ids), sampling, predicted_tokens)
        seq.priority = Priority(priority)
        if adapter and not self.config.max_loras:
            raise ValueError(f"request {request_id!r}: this engine serves no LoRA adapters")
        if is_adapter_table(request_id):
            raise ValueError(f"request id {request_id!r} is reserved for adapter slots")
        seq.adapter, seq.awaiting_adapter = adapter, awaiting_adapter and bool(adapter)
        seq.guide = guide
        seq.awaiting_guide = awaiting_guide and guide is None
        seq.releasable = releasable
        self._check_admissible(seq)
        seq.cache_salt = cache_salt
        if self.config.prefix_caching:
            seq.root_hash = root_hash(self.config.model_name, cache_salt, adapter)
        seq.arrival_index = self._next_arrival
        self._next_arrival += 1
        self._live[request_id] = seq
        self._waiting.add(seq)
        return seq

    def _check_admissible(self, seq: Sequence) -> None:
        rid, cfg = seq.request_id, self.config
        # A step still in flight may hold a row of an earlier request of this id: its late
        # results are told apart by the row's serial, not the id.
        if rid in self._live or rid in self._left_since_step or self._blocks.has_table(rid):
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
        peak_blocks = self._blocks.blocks_needed(num_prompt + max_tokens - 1)
        if peak_blocks > cfg.num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) "
                f"needs up to {peak_blocks} KV blocks, the whole cache has {cfg.num_blocks}"
            )

    def set_guide(self, request_id: str, guide: Guide) -> None:
        """The grammar of a request added `awaiting_guide` is ready: it may be admitted."""
        seq = self._live[request_id]
        if not seq.awaiting_guide:
            raise ValueError(f"request {request_id!r} is not waiting for its grammar")
        seq.guide = guide
        seq.awaiting_guide = False

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """Retire a live sequence now (cancel, stop string) and free its blocks.

        False, with nothing changed, for an unknown or already finished id.
        """
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._retire(seq, reason)
        self._end_static_batch_if_done()
        return True

    def release_queued(self, max_requests: int) -> list[Sequence]:
        """Hand back up to `max_requests` never-scheduled waiting sequences for offloading.

        Takes those that would wait longest (the tail of the admission order); they finish as
        RELEASED and are returned in admission order. Preempted sequences are never released,
        nor those whose grammar is compiling here (elsewhere it would compile again).
        """
        if max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {max_requests}")
        if max_requests == 0:
            return []
        fresh = [
            seq
            for seq in self._waiting
            if not seq.ever_scheduled and seq.releasable and not seq.awaiting_guide
        ]
        released = fresh[-max_requests:]
        for seq in released:
            self._retire(seq, FinishReason.RELEASED)
        return released

    def get(self, request_id: str) -> Sequence | None:
        """The live (waiting or running) sequence with this id, if any."""
        return self._live.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def queue_lengths(self) -> tuple[int, int]:
        """(waiting, running) sequences: stats() without its walk over every sequence."""
        return len(self._waiting), len(self._running)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step, class by class from interactive down: each class's running
        sequences (its decodes in bulk, then its prefill chunks), then its admissions, so a
        higher class takes the step's budget first."""
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        cfg = self.config
        budget = StepBudget.for_step(
            cfg.max_num_batched_tokens,
            cfg.background_step_tokens,
            self._step_cost.current,
            cfg.background_step_slack,
        )
        self._budget = budget
        # A class whose waiting sequences change during this step (a victim joins them) admits
        # nobody in it, by the rule below: the class's queue is as it was when the step began.
        self._hold = None
        for priority in Priority:
            self._schedule_running(priority, chunks, preempted, budget)
            self._end_static_batch_if_done()
            # Admitting right after a preemption of this class or a higher one would only
            # thrash: the victim's blocks are needed by sequences that outrank the candidates.
            # Victims of a lower class (taken to admit a higher one) do not hold it back.
            if any(victim.priority <= priority for victim in preempted):
                continue
            if not (self._static and self._running):
                self._admit_waiting(priority, chunks, budget, preempted)
            if priority is Priority.INTERACTIVE:
                # One left waiting that is ready (not compiling a grammar or loading an adapter)
                # is held up by a slot or blocks: background work must not slow the step more.
                waiting = any(
                    not (seq.awaiting_guide or seq.awaiting_adapter)
                    for seq in self._waiting.of_class(priority)
                )
                rows = self._running_count[priority]
                budget.interactive_planned(rows, waiting, cfg.max_num_seqs)
        self._budget = None
        if self._slots is not None:
            self._slots.touch(self._running_adapters.keys())
            self._prefetch_adapters()
        # Nobody waited for a slot: a drained adapter that no longer runs is chosen anew.
        drain = self._drain
        if drain is not None and self._hold is None:
            self._drain = drain if any(seq.adapter == drain for seq in self._running) else None
        left = frozenset(self._left_since_step) | {victim.request_id for victim in preempted}
        self._left_since_step.clear()
        decoding = self._decoding
        decodes = np.flatnonzero(decoding)
        if decodes.size:
            decoding[decodes] = False
        if chunks or decodes.size:
            self._iterations += 1
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight[step_id] = None
        if self._unsampled:
            self._unsampled_by_step[step_id] = self._unsampled
            self._unsampled = []
        plan = self._cache.take_copies(self.config.max_blocks_per_step, step_id)
        batch = self._batch
        decode_seqs = batch.pick(batch.seqs, decodes)
        pending = batch.pending[decodes]
        tokens = batch.tokens[decodes]
        joined, self._joined = tuple(self._joined), []
        return SchedulerOutput(
            prefill_chunks=tuple(chunks),
            prefill_serials=tuple(batch.serial[[c.row for c in chunks]].tolist()),
            finished_request_ids=left,
            preempted_request_ids=frozenset(victim.request_id for victim in preempted),
            step_id=step_id,
            kv_copies=plan.copies,
            kv_copies_before_step=plan.before_step,
            kv_copies_wait_for_step=plan.wait_for_step,
            num_tokens=budget.scheduled_tokens,
            context_tokens=budget.context,
            decode_rows=decodes,
            decode_positions=batch.computed[decodes] - 1,
            decode_generated=tokens - 1 - batch.prompt_len[decodes],
            decode_serials=batch.serial[decodes],
            decode_pending=pending > 1,
            decode_tables=batch.held[decodes],
            decode_seqs=decode_seqs,  # type: ignore[arg-type]
            joined=joined,
            table_delta=self._table_delta(),
            special_decodes=tuple(np.flatnonzero(batch.guided[decodes]).tolist()),
            decode_keys=batch.prio[decodes] * _CLASS_KEY + batch.order[decodes],
            prefill_keys=self._prefill_keys(chunks),
            table_of=self._blocks.table_if_held,
            adapter_slots=None if self._slots is None else self._slots.take_mapping(),
        )

    def _prefill_keys(self, chunks: list[ScheduledChunk]) -> tuple[int, ...]:
        """Each prefill chunk's planning key (SchedulerOutput.chunks sorts by it)."""
        if not chunks:
            return ()
        batch, rows = self._batch, [chunk.row for chunk in chunks]
        return tuple((batch.prio[rows] * _CLASS_KEY + batch.order[rows]).tolist())

    def _table_delta(self) -> tuple[IntArray, IntArray, IntArray]:
        """The blocks added to running rows' tables since the last step, for the runner, as
        (rows, positions in their tables, blocks)."""
        parts, self._table_parts = self._table_parts, []
        if self._grown:
            batch, blocks = self._batch, self._blocks
            rows: list[int] = []
            cols: list[int] = []
            added: list[int] = []
            for row in sorted(self._grown):
                seq = batch.seqs[row]
                if seq is None:
                    continue  # left again (preempted) before the step
                start, held = int(batch.synced[row]), int(batch.held[row])
                if held > start:
                    table = blocks.block_table(seq.request_id)
                    rows += [row] * (held - start)
                    cols += range(start, held)
                    added += table[start:held]
                    batch.synced[row] = held
            self._grown.clear()
            if rows:
                parts.append((np.array(rows), np.array(cols), np.array(added)))
        if not parts:
            return _NO_DELTA
        if len(parts) == 1:
            return parts[0]
        return (
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]),
        )

    def _schedule_running(
        self,
        priority: Priority,
        chunks: list[ScheduledChunk],
        preempted: list[Sequence],
        budget: StepBudget,
    ) -> None:
        """Schedule the running sequences of one class: its decodes in bulk (one token each for
        every row whose only uncomputed token is the one it sampled last), then its prefill
        chunks in admission order."""
        if self._running_count[priority] == 0:
            return
        batch = self._batch
        rows = batch.rows_of(priority)
        computed, tokens = batch.computed[rows], batch.tokens[rows]
        live = tokens < batch.limit[rows]  # done but for pending tokens: its last step retires it
        wanted = tokens - computed
        decode = live & (wanted == 1) & batch.fed[rows]
        prefill = rows[live & ~decode & (wanted > 0)]
        decodes = rows[decode]
        if decodes.size:
            if priority.is_background and budget.timed:
                self._schedule_timed_decodes(decodes, preempted, budget)
            else:
                self._schedule_decodes(decodes, preempted, budget)
        if prefill.size:
            for row in batch.by_order(prefill).tolist():
                seq = batch.seqs[row]
                if seq is None:
                    continue  # preempted for an earlier one's growth
                if not self._schedule_prefill(seq, chunks, preempted, budget):
                    break  # `seq` itself was the last one of its class and got preempted

    def _schedule_decodes(
        self, rows: IntArray, preempted: list[Sequence], budget: StepBudget
    ) -> None:
        """One token for each of `rows` (a decode, never deferred: only the step's budget
        bounds it), the oldest first if the budget cannot take them all; a new block for the
        rows whose token starts one."""
        batch = self._batch
        if rows.size > budget.tokens:
            rows = batch.by_order(rows)[: max(budget.tokens, 0)]
        size = self.config.block_size
        grow = rows[batch.computed[rows] >= batch.held[rows] * size]
        if grow.size:
            ordered = batch.by_order(grow)
            given = self._blocks.grow_by_one(batch.pick(batch.ids, ordered))
            if given:
                grown = ordered[: len(given)]
                self._table_parts.append((grown, batch.held[grown], np.array(given)))
                batch.held[grown] += 1
                batch.synced[grown] += 1  # told the runner with this step's table delta
            # Out of free blocks: the rest one at a time, preempting the newest for room.
            for row in ordered[len(given) :].tolist():
                seq = batch.seqs[row]
                if seq is None:
                    continue  # preempted for an older one's block
                if not self._grow(seq, int(batch.computed[row]) + 1, preempted):
                    break  # `seq` and everything newer of its class were preempted
            # A victim's row is free now (no admission takes it before this class's decodes).
            rows = rows[batch.active[rows]]
        if rows.size:
            self._commit_decodes(rows)
            budget.tokens -= int(rows.size)
            budget.context += int(self._batch.computed[rows].sum())

    def _commit_decodes(self, rows: IntArray) -> None:
        """`rows` decode in this step: one more position computed, one more token sampled."""
        batch = self._batch
        batch.computed[rows] += 1
        batch.tokens[rows] += 1
        batch.pending[rows] += 1
        self._decoding[rows] = True

    def _schedule_timed_decodes(
        self, rows: IntArray, preempted: list[Sequence], budget: StepBudget
    ) -> None:
        """Background decodes while the step's background time is bounded (step_budget.py):
        in admission order, each while its time fits, one at a time."""
        batch = self._batch
        size = self.config.block_size
        for row in batch.by_order(rows).tolist():
            seq = batch.seqs[row]
            if seq is None:
                continue
            if budget.allowance(seq, 1) < 1:
                continue  # waits, keeping its blocks, for a step with room
            computed = int(batch.computed[row])
            if computed >= int(batch.held[row]) * size and not self._grow(
                seq, computed + 1, preempted
            ):
                break
            self._commit_decodes(np.array([row], dtype=np.int64))
            budget.take(seq, 1, 1)

    def _schedule_prefill(
        self,
        seq: Sequence,
        chunks: list[ScheduledChunk],
        preempted: list[Sequence],
        budget: StepBudget,
    ) -> bool:
        """The next prefill chunk of running `seq` as its budget allows; False if `seq` had to
        be preempted for its blocks."""
        wanted = seq.num_tokens - seq.num_computed_tokens
        num_new = budget.allowance(seq, wanted)
        if num_new <= 0:
            return True
        num_total = seq.num_computed_tokens + num_new
        if not self._grow(seq, num_total, preempted):
            return False
        chunks.append(self._chunk(seq, num_new))
        budget.take(seq, wanted, num_new)
        return True

    def _grow(self, seq: Sequence, num_tokens_total: int, preempted: list[Sequence]) -> bool:
        """Grow `seq`'s table to `num_tokens_total` slots, preempting running sequences (the
        lowest class first, the newest of it first, never one of a higher class than `seq`) as
        long as needed. Returns False if `seq` had to be preempted itself."""
        blocks = self._blocks
        while not blocks.try_grow(seq.request_id, num_tokens_total):
            if self._evict_idle_adapter(()):
                continue  # an idle adapter's blocks before any sequence's
            victim = self._victim(seq.priority)
            assert victim is not None  # `seq` itself qualifies
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        row = seq.row
        self._batch.held[row] = blocks.num_held(seq.request_id)
        self._grown.add(row)
        return True

    def _stop_running(self, seq: Sequence) -> None:
        del self._running[seq]
        self._running_count[seq.priority] -= 1
        if seq.adapter:
            adapters = self._running_adapters
            adapters[seq.adapter] -= 1
            if not adapters[seq.adapter]:
                del adapters[seq.adapter]

    def _victim(self, lowest: int) -> Sequence | None:
        """The running sequence to preempt first among those of class `lowest` or below: the
        lowest class, the newest of it (a decode of it planned in this step is taken back)."""
        return pick_victim(list(self._running), lowest)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: its blocks go back, it re-prefills prompt + generated tokens
        later, ahead of its class (admission_order puts preempted sequences first)."""
        batch = self._batch
        row = seq.row
        if self._decoding[row]:
            # Its decode was planned in this step already (decodes go first): taken back.
            self._decoding[row] = False
            total = int(batch.computed[row])
            batch.computed[row] -= 1
            batch.tokens[row] -= 1
            batch.pending[row] -= 1
            if self._budget is not None:
                self._budget.tokens += 1
                self._budget.context -= total
        serial = int(batch.serial[row])
        self._stop_running(seq)
        self._blocks.free(seq.request_id)
        batch.detach(seq)
        if seq.num_pending:
            self._orphans[serial] = seq  # `update` still gives it its tokens in flight
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self._preemptions_by_class[seq.priority] += 1
        self._waiting.add(seq)  # its key puts it ahead of its class's fresh ones

    def _runs_below(self, priority: Priority) -> bool:
        """Whether a sequence of a class below `priority` runs (one `_victim` could take)."""
        return any(self._running_count[lower] for lower in Priority if lower > priority)

    def _admit_waiting(
        self,
        priority: Priority,
        chunks: list[ScheduledChunk],
        budget: StepBudget,
        preempted: list[Sequence],
    ) -> None:
        """Admit the waiting sequences of one class in policy order while they fit, preempting
        running sequences of lower classes for a batch slot or KV blocks."""
        cfg = self.config
        candidates = self._waiting.of_class(priority)  # only admissions below change it
        if not candidates:
            return
        if len(self._running) >= cfg.max_num_seqs and not self._runs_below(priority):
            return  # skip planning when nobody can be admitted anyway
        plan_limit = cfg.num_blocks - cfg.watermark_blocks
        planned, outranking = self._planned_for(priority)
        admitted = 0
        adapters = self._running_adapters.keys()
        for index, seq in enumerate(candidates):
            # A static batch may take members beyond this step's token budget: they prefill in
            # later steps, as members of the same batch.
            if budget.tokens == 0 and not self._static:
                break
            if seq.awaiting_guide:
                continue  # not ready: it does not hold up the requests behind it
            if seq.adapter and seq.adapter == self._hold:
                continue  # behind a request that waits for this adapter's slot
            if not self._adapter_ready(seq, adapters):
                if self._slots is not None and self._slot_free(seq, adapters):
                    break  # its adapter's blocks are not free: as a sequence that does not fit
                # As for a grammar, the requests behind it go on, but for one adapter's: while
                # it waits for a slot, that adapter drains and gives its slot up.
                if not seq.awaiting_adapter and self._overtaken_enough(seq):
                    self._hold_adapter(seq, adapters, islice(candidates, index + 1, None))
                continue
            if seq.num_pending:
                break  # preempted with a token still on the device: re-prefill needs its value
            hit = self._cache.lookup(seq)
            need = self._planned_blocks(seq) - self._blocks.shared_in_use(hit)
            if self._slots is not None and seq.adapter and seq.adapter not in adapters:
                # Unified slots: its adapter's blocks, idle until now (left out of `planned`).
                need += self._slots.blocks_per_adapter
            # The plan counts this class and higher ones only: a lower class's expected growth
            # does not hold a higher class back (its sequences are preempted if KV runs out).
            if outranking and planned + need > plan_limit:
                break  # strict policy order: nobody overtakes a candidate that does not fit
            cached = hit.num_blocks * cfg.block_size
            wanted = seq.num_tokens - cached
            num_new = budget.allowance(seq, wanted, cached)
            if num_new == 0 and not self._static:
                break  # the deferral bound: this background prefill waits for a later step
            # Blocks copied back from the host tier: the copies overlap this step, the
            # sequence computes from the next one (which waits for them) and this step waits
            # for no copy (vLLM's asynchronous KV loads). Static batches keep their own rule.
            onload = bool(hit.host_slots) and not self._static
            if onload:
                num_new = 0
            # A victim's freed blocks stay indexed, so `hit` holds after preemptions.
            if not self._has_room(hit, cached + num_new) and not (
                self._room_from_idle_adapters(seq, hit, cached + num_new)
                or self._evict_below(priority, hit, cached + num_new, preempted)
            ):
                break
            self._waiting.admitting(seq)
            self._blocks.admit(seq.request_id, hit, cached + num_new, defer_onload=onload)
            self._take_row(seq)
            self._cache.admitted(seq, hit)
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            seq.ever_scheduled = True
            seq.slot_wait_since = -1  # a preempted one counts its wait afresh
            self._running[seq] = None
            self._running_count[priority] += 1
            if seq.adapter:
                self._running_adapters[seq.adapter] += 1
            planned += need
            outranking = True
            admitted += 1
            if num_new > 0:
                chunks.append(self._chunk(seq, num_new))
                budget.take(seq, wanted, num_new)
        self._waiting.drop_admitted(priority, admitted)

    def _take_row(self, seq: Sequence) -> None:
        """An admitted `seq` (its table made) takes a row of the running batch; the model
        runner hears of it with the next step."""
        batch = self._batch
        row = batch.attach(seq, self.config.max_model_len)
        batch.held[row] = self._blocks.num_held(seq.request_id)
        self._grown.add(row)
        self._joined.append(
            RowJoin(
                row,
                seq.request_id,
                seq.sampling,
                seq.adapter,
                seq.guide,
                seq.output_token_ids,
                seq.prompt_token_ids,
            )
        )

    def _evict_below(
        self,
        priority: Priority,
        hit: CacheHit,
        num_tokens_total: int,
        preempted: list[Sequence],
    ) -> bool:
        """Preempt running sequences of classes below `priority` (the lowest class first, the
        newest of it first) until the candidate admitted with `hit` has a batch slot and blocks
        for its first chunk. False, having preempted none, if preempting them all would not
        make that room: a victim that could not help would only lose its work."""
        if not self._runs_below(priority):
            return False
        lower = [victim for victim in self._running if victim.priority > priority]
        seats = len(self._running) - len(lower) < self.config.max_num_seqs
        if not (lower and seats and room_without(self._blocks, lower, hit, num_tokens_total)):
            return False
        while not self._has_room(hit, num_tokens_total):
            victim = self._victim(priority + 1)
            assert victim is not None  # preempting all of `lower` makes room
            self._preempt(victim)
            preempted.append(victim)
        return True

    def _has_room(self, hit: CacheHit, num_tokens_total: int) -> bool:
        """A batch slot and the blocks for an admission's first chunk are free now."""
        return len(self._running) < self.config.max_num_seqs and self._blocks.can_admit(
            hit, num_tokens_total
        )

    def _planned_for(self, priority: Priority) -> tuple[int, bool]:
        """Blocks the admission plan of class `priority` counts as taken: those held now (a
        shared one once) plus what each holder is still planned to grow by, leaving out the
        holders of lower classes; and whether any holder of this class or a higher one runs.

        A block a lower class shares with a higher one is left out too: the plan errs towards
        admitting, and the admission's real check (`_has_room`) is exact."""
        blocks, batch = self._blocks, self._batch
        planned = blocks.num_used_blocks
        if self._slots is not None:
            # Idle adapters give their blocks back before a sequence waits for them.
            planned -= self._slots.idle_blocks(self._running_adapters.keys())
        size = self.config.block_size
        rows = batch.rows()
        prio = batch.prio[rows]
        below = prio > priority
        held = batch.held[rows]
        planned -= int(held[below].sum())
        mine = ~below
        outranking = bool(mine.any())
        if outranking:
            # Each holder's expected total (or what it holds now, if more) in blocks, past what
            # it holds: _planned_blocks over the rows at once.
            tokens = np.maximum(batch.expected_total[rows[mine]], batch.tokens[rows[mine]])
            growth = -(-tokens // size) - held[mine]
            planned += int(growth[growth > 0].sum())
        for seq in self._held:  # static mode: finished members still holding blocks
            count = blocks.num_held(seq.request_id)
            if seq.priority > priority:
                planned -= count
                continue
            tokens_held = max(seq.expected_total_tokens, seq.num_tokens)
            planned += max(-(-tokens_held // size) - count, 0)
            outranking = True
        return max(planned, 0), outranking

    def _adapter_ready(self, seq: Sequence, running: Collection[str]) -> bool:
        """Whether `seq`'s adapter (if any) is in host memory and has a device slot to go to:
        the running sequences use at most max_loras distinct adapters, one step's worth."""
        if not seq.adapter:
            return True
        if seq.awaiting_adapter:
            return False
        if seq.adapter in running:
            return True
        if len(running) >= self.config.max_loras:
            return False
        if self._slots is None:
            return True
        return self._slots.take(seq.adapter, running, self._adapter_demand)

    def _slot_free(self, seq: Sequence, running: Collection[str]) -> bool:
        """Whether `seq` (whose adapter is loaded in host memory) has a slot under the cap,
        so that only blocks stand between its adapter and residency."""
        return not seq.awaiting_adapter and len(running) < self.config.max_loras

    def _adapter_demand(self) -> Counter[str]:
        """Waiting requests by adapter (the eviction order's first key)."""
        return Counter(seq.adapter for seq in self._waiting if seq.adapter)

    def _evict_idle_adapter(self, also_in_use: Collection[str]) -> bool:
        """Unified slots: an idle adapter (none running, none of `also_in_use`) gives its
        blocks back to the pool; whether one did."""
        slots = self._slots
        if slots is None:
            return False
        in_use = set(self._running_adapters) | set(also_in_use)
        return slots.evict_one(in_use, self._adapter_demand)

    def _room_from_idle_adapters(self, seq: Sequence, hit: CacheHit, num_tokens_total: int) -> bool:
        """Idle adapters (not `seq`'s) evicted until `seq`'s first chunk has its blocks, before
        any sequence is preempted for them; whether it has room now. None is evicted if that
        would not make the room (no batch slot, or too few idle blocks): an adapter evicted
        for nothing would only be written again."""
        slots = self._slots
        if slots is None or len(self._running) >= self.config.max_num_seqs:
            return False
        mine = (seq.adapter,) if seq.adapter else ()
        idle = slots.idle_blocks(set(self._running_adapters) | set(mine))
        if self._blocks.admit_shortfall(hit, num_tokens_total) > idle:
            return False
        while not self._has_room(hit, num_tokens_total):
            if not self._evict_idle_adapter(mine):
                return False
        return True

    def _prefetch_adapters(self) -> None:
        """The adapters of the first waiting requests (in admission order, loaded in host
        memory) take their blocks while the pool keeps the watermark and the request's own
        blocks free: their weights are written before their requests run. A prefetched adapter
        is idle, so the first to give its blocks back if sequences need them."""
        slots = self._slots
        assert slots is not None
        watermark = self.config.watermark_blocks
        for seq in islice(self._waiting, slots.cap):
            if not seq.adapter or seq.awaiting_adapter:
                continue
            keep = watermark + self._blocks.blocks_needed(seq.num_tokens)
            if not slots.prefetch(seq.adapter, keep):
                break

    def evict_idle_adapters(self) -> int:
        """Unified slots: every idle adapter gives its blocks back (before the cache's top is
        lent: kv_lending.py lends only free blocks, and an adapter's may sit there); how many."""
        evicted = 0
        while self._evict_idle_adapter(()):
            evicted += 1
        return evicted

    def drop_adapter(self, adapter: str) -> None:
        """`adapter` is no longer served (it has no live request): its slot's blocks go back."""
        if self._slots is not None:
            self._slots.drop(adapter)

    @property
    def unified_slots(self) -> UnifiedSlots | None:
        """The adapter slots in the KV pool (None: fixed slots)."""
        return self._slots

    def _overtaken_enough(self, seq: Sequence) -> bool:
        """Whether `seq`, which finds every adapter slot taken, has been overtaken for
        adapter_overtake_steps steps (counted from the first step it found them taken) and
        nobody is held back for it yet in this step."""
        if seq.slot_wait_since < 0:
            seq.slot_wait_since = self._next_step_id
        waited = self._next_step_id - seq.slot_wait_since
        return self._hold is None and waited >= self.config.adapter_overtake_steps

    def _hold_adapter(
        self, seq: Sequence, running: Collection[str], behind: Iterable[Sequence]
    ) -> None:
        """`seq` waits for an adapter slot (all max_loras are `running`): hold back the new
        requests of the adapter being drained, chosen anew unless the last choice still runs
        and is not kept running by a class above `seq`'s."""
        drain = self._drain
        if drain is None or drain not in running or outranked(self._running, drain, seq.priority):
            drain = adapter_to_drain(self._running, seq.priority, behind)
        self._drain = self._hold = drain

    def adapter_loaded(self, adapter: str) -> None:
        """`adapter` is in host memory: the requests that wait for it may be admitted."""
        for seq in self._waiting:
            if seq.adapter == adapter:
                seq.awaiting_adapter = False

    def awaiting_adapter(self, adapter: str) -> list[str]:
        """The requests waiting for `adapter` to load."""
        return [s.request_id for s in self._waiting if s.adapter == adapter and s.awaiting_adapter]

    def live_adapters(self) -> set[str]:
        """The adapters of the requests waiting or running now."""
        return {seq.adapter for seq in self._live.values() if seq.adapter}

    def _planned_blocks(self, seq: Sequence) -> int:
        """Blocks the admission plan reserves for `seq`: its expected total, or more if it
        already needs more (it outran its prediction, or it is a preempted one coming back)."""
        tokens = max(seq.expected_total_tokens, seq.num_tokens)
        waiting = seq.status is SequenceStatus.WAITING
        held = 0 if waiting else self._blocks.num_held(seq.request_id)
        return max(self._blocks.blocks_needed(tokens), held)

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        """The prefill chunk of `seq`'s next `num_new` positions (all of them known tokens: a
        row that sampled decodes instead); they count as computed from now on."""
        start = seq.num_computed_tokens
        end = start + num_new
        output = seq.output_token_ids
        num_prompt = len(seq.prompt_token_ids)
        num_output = len(output) + seq.num_pending
        penalized = seq.sampling.penalized
        row = seq.row
        chunk = ScheduledChunk(
            request_id=seq.request_id,
            token_ids=seq.token_ids_between(start, end),
            start_position=start,
            block_table=self._blocks.block_table(seq.request_id),
            sample=end == num_prompt + num_output,
            sampling=seq.sampling,
            num_generated=num_output,
            guide=seq.guide,
            history=output if penalized else (),
            prompt_token_ids=seq.prompt_token_ids if penalized else (),
            adapter=seq.adapter,
            row=row,
        )
        batch = self._batch
        batch.computed[row] = end
        if start < num_prompt:
            self._cache.computed(seq, start, end)
        if chunk.sample:
            batch.pending[row] += 1
            batch.tokens[row] += 1
            batch.fed[row] = True
        else:
            self._unsampled.append(seq.request_id)
        return chunk

    def advance_guides(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Moves the grammars of `output`'s constrained rows past the tokens it sampled, before
        `update`: the next step's masks read them, and can fill on another thread while the
        rest of the update (every row's bookkeeping) runs (PagedEngine._step). `update` of the
        same step takes these verdicts instead of advancing again."""
        oldest = next(iter(self._in_flight), None)
        if output.step_id != oldest:
            raise ValueError(f"step {output.step_id} is not the oldest awaiting results ({oldest})")
        tokens = self._sampled_tokens(output, result)
        verdicts: dict[str, FinishReason | None] = {}
        for index, seq in self._guided_entries(output):
            verdicts[seq.request_id] = self._advance_guide(seq, int(tokens[index]))
        self._guided = (output.step_id, verdicts)

    def _guided_entries(self, output: SchedulerOutput) -> list[tuple[int, Sequence]]:
        """(sample index, sequence) of the step's constrained rows still running as planned."""
        batch = self._batch
        entries: list[tuple[int, Sequence]] = []
        for index in output.special_decodes:
            row = int(output.decode_rows[index])
            if batch.serial[row] == output.decode_serials[index]:
                entries.append((index, output.decode_seqs[index]))
        index = output.num_decodes
        for chunk, serial in zip(output.prefill_chunks, output.prefill_serials, strict=True):
            if not chunk.sample:
                continue
            seq = batch.seqs[chunk.row]
            if seq is not None and seq.guide is not None and batch.serial[chunk.row] == serial:
                entries.append((index, seq))
            index += 1
        return entries

    def _sampled_tokens(self, output: SchedulerOutput, result: ModelRunnerOutput) -> IntArray:
        """The step's sampled tokens in its sample order (decode rows, then sampling chunks);
        ValueError, nothing changed, if one is missing for a sequence still here."""
        count = output.num_sampled
        if result.tokens is not None:
            if len(result.tokens) != count:
                raise ValueError(f"{len(result.tokens)} sampled tokens for {count} sampled rows")
            return result.tokens
        sampled = result.sampled_token_ids
        ids = output.sample_request_ids()
        missing = [rid for rid in ids if rid not in sampled and rid in self._live]
        if missing:
            raise ValueError(f"no sampled token for request(s) {sorted(missing)}")
        return np.array([sampled.get(rid, NO_TOKEN) for rid in ids], dtype=np.int64)

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> StepOutputs:
        """Apply a step's results: resolve its pending tokens and retire the sequences that
        finished (their blocks are free when this returns, except in static mode); the step's
        outputs, one entry per sampled sequence still here (a token, maybe a finish).

        Steps must be updated once each, in the order they were scheduled. Rows of sequences
        that left since `schedule` (cancelled, or finished by an earlier step) are ignored; a
        sequence preempted since still gets its token.
        """
        oldest = next(iter(self._in_flight), None)
        if output.step_id != oldest:
            raise ValueError(
                f"step {output.step_id} is not the oldest step awaiting results ({oldest}); "
                "was update() applied twice, out of order, or to a stale SchedulerOutput?"
            )
        tokens = self._sampled_tokens(output, result)
        del self._in_flight[output.step_id]
        guided: dict[str, FinishReason | None] = {}
        if self._guided is not None and self._guided[0] == output.step_id:
            guided = self._guided[1]
        self._guided = None
        outputs = StepOutputs()
        # Sequences with blocks to index, registered together (SequenceCache.register_all)
        # before any retirement frees blocks; the sequences that finished, in order.
        filled: list[tuple[Sequence, int]] = self._unsampled_filled(output.step_id)
        finishing: list[tuple[Sequence, FinishReason]] = []
        count = output.num_decodes
        if count:
            self._apply_decodes(output, tokens[:count], guided, outputs, filled, finishing)
        index = count
        for chunk, serial in zip(output.prefill_chunks, output.prefill_serials, strict=True):
            if chunk.sample:
                token = int(tokens[index])
                self._apply_token(chunk.row, serial, token, guided, outputs, filled, finishing)
                index += 1
        if filled:
            self._cache.register_all(filled)
        for seq, reason in finishing:
            self._retire(seq, reason)
        self._end_static_batch_if_done()
        return outputs

    def _unsampled_filled(self, step_id: int) -> list[tuple[Sequence, int]]:
        """The sequences whose prefill chunks of step `step_id` sampled nothing and filled a
        block: indexed only now, once the step that writes them is launched (a block indexed in
        `schedule` could be hit by a chunk of the same step, which the runner may run before
        the chunk that writes it)."""
        unsampled = self._unsampled_by_step.pop(step_id, ())
        if not self._blocks.caching:
            return []
        filled: list[tuple[Sequence, int]] = []
        for request_id in unsampled:
            seq = self._live.get(request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_computed_tokens >= seq.next_full_block_at:
                filled.append((seq, self._cache.full_blocks(seq)))
        return filled

    def _apply_decodes(
        self,
        output: SchedulerOutput,
        tokens: IntArray,
        guided: dict[str, FinishReason | None],
        outputs: StepOutputs,
        filled: list[tuple[Sequence, int]],
        finishing: list[tuple[Sequence, FinishReason]],
    ) -> None:
        """The decode rows' tokens, in bulk for the rows still held by the sequences they were
        planned for; one at a time for the others (preempted since: they keep their token)."""
        batch = self._batch
        rows, seqs = output.decode_rows, output.decode_seqs
        live = batch.serial[rows] == output.decode_serials
        if not live.all():
            for i in np.flatnonzero(~live).tolist():
                serial = int(output.decode_serials[i])
                self._apply_token(-1, serial, int(tokens[i]), guided, outputs, filled, finishing)
            keep = np.flatnonzero(live)
            rows, tokens = rows[keep], tokens[keep]
            seqs = [seqs[i] for i in keep.tolist()]
            if not seqs:
                return
        batch.pending[rows] -= 1
        values = tokens.tolist()
        # One C-level loop appends every row's token to its answer (no Python call per row).
        deque(map(list.append, batch.pick(batch.outs, rows), values), maxlen=0)
        first = outputs.add_rows(batch.pick(batch.ids, rows), values, list(seqs))
        outputs.decoded += len(values)  # a decode row had a token before this one
        stop = batch.tokens[rows] - batch.pending[rows] >= batch.limit[rows]
        eos = self._eos
        if eos.size:
            hit = tokens == eos[0] if eos.size == 1 else np.isin(tokens, eos)
            stop |= hit & ~batch.ignore_eos[rows]
        if self._blocks.caching:
            fill = np.flatnonzero(batch.computed[rows] >= batch.next_full[rows])
            if fill.size:
                # SequenceCache.full_blocks of every filled row at once.
                fill_rows = rows[fill]
                known = batch.tokens[fill_rows] - batch.pending[fill_rows]
                num_full = np.minimum(batch.computed[fill_rows], known) // self.config.block_size
                batch.next_full[fill_rows] = (num_full + 1) * self.config.block_size
                filled += zip([seqs[i] for i in fill.tolist()], num_full.tolist(), strict=True)
        for i in np.flatnonzero(stop | batch.guided[rows]).tolist():
            seq = seqs[i]
            reason = self._reason(seq, values[i], guided)
            if reason is not None:
                finishing.append((seq, reason))
                outputs.finish(first + i, reason, seq.error)
                if reason is FinishReason.ERROR:
                    outputs.drop_token(first + i)  # a token its grammar refused: no answer

    def _apply_token(
        self,
        row: int,
        serial: int,
        token: int,
        guided: dict[str, FinishReason | None],
        outputs: StepOutputs,
        filled: list[tuple[Sequence, int]],
        finishing: list[tuple[Sequence, FinishReason]],
    ) -> None:
        """One sampled token of the row that had `serial` when planned: its sequence's, if it
        still runs there or was preempted since (then it waits and still gets the token)."""
        batch = self._batch
        if row >= 0 and batch.serial[row] == serial:
            seq = batch.seqs[row]
            assert seq is not None
            batch.pending[row] -= 1
        else:
            orphan = self._orphans.get(serial)
            if orphan is None:
                return  # it left the engine: its late tokens are no one's
            if self._live.get(orphan.request_id) is not orphan:
                del self._orphans[serial]
                return
            seq = orphan
            seq.num_pending -= 1
            if not seq.num_pending:
                del self._orphans[serial]
        seq.output_token_ids.append(token)
        if len(seq.output_token_ids) > 1:
            outputs.decoded += 1
        running = seq.status is SequenceStatus.RUNNING
        if self._blocks.caching and running and seq.num_computed_tokens >= seq.next_full_block_at:
            filled.append((seq, self._cache.full_blocks(seq)))
        reason = self._reason(seq, token, guided)
        index = outputs.add(seq.request_id, token, source=seq)
        if reason is not None:
            finishing.append((seq, reason))
            outputs.finish(index, reason, seq.error)
            if reason is FinishReason.ERROR:
                outputs.drop_token(index)

    def _reason(
        self, seq: Sequence, token: int, guided: dict[str, FinishReason | None]
    ) -> FinishReason | None:
        """Why `seq` finishes with `token` just appended, if it does: its grammar's verdict
        (advance_guides', or advanced now), else the stop conditions."""
        if seq.request_id in guided:
            reason = guided[seq.request_id]
        else:
            reason = self._advance_guide(seq, token) if seq.guide is not None else None
        return reason or self._stop_reason(seq, token)

    def _advance_guide(self, seq: Sequence, token: int) -> FinishReason | None:
        """Moves a constrained sequence's grammar past `token`; STOP once the grammar says the
        answer is complete (nothing but the end may follow), ERROR if it refused the token."""
        guide = seq.guide
        if guide is None or token in self.config.eos_token_ids:
            return None
        if not guide.consume(token):
            # The mask allowed it, so the grammar engine gave up on this answer (one of its
            # limits, mid-answer) or broke: the answer so far is no complete answer.
            reason = guide.error or "no reason given"
            log.warning("request %s: its grammar refused token %d: %s", seq.request_id, token,
                        reason)  # fmt: skip
            seq.error = f"the grammar engine gave up on the answer's constraint midway: {reason}"
            return FinishReason.ERROR
        return FinishReason.STOP if guide.is_finished() else None

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why `seq` stops at `token`, its newest known token (pending ones come after it)."""
        if not seq.sampling.ignore_eos and token in self.config.eos_token_ids:
            return FinishReason.STOP
        known = len(seq.output_token_ids)
        if known >= seq.sampling.max_tokens:
            return FinishReason.LENGTH
        if len(seq.prompt_token_ids) + known >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        was_running = seq.status is SequenceStatus.RUNNING
        if was_running:
            self._stop_running(seq)
            self._batch.detach(seq)  # its tokens still in flight, if any, are no one's
        else:
            self._waiting.remove(seq)
        del self._live[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.ever_scheduled:
            # Only a sequence some step computed has state for the model runner to drop (its
            # sampler's), reported with the next step. One never scheduled (released for
            # offload, cancelled while queued) is forgotten now: its id is free at once, also
            # on an idle engine that schedules no step before it comes back (A -> B -> A).
            self._left_since_step.add(seq.request_id)
        if not was_running:
            return
        if self._static and reason in _NATURAL_FINISH:
            self._held.append(seq)
        else:
            self._blocks.free(seq.request_id)

    def _end_static_batch_if_done(self) -> None:
        if self._running or not self._held:
            return
        for seq in self._held:
            self._blocks.free(seq.request_id)
        self._held.clear()

    def stats(self) -> SchedulerStats:
        batch = self._batch
        rows = batch.rows()
        prio = batch.prio[rows]
        computed = batch.computed[rows]
        remaining = self._running_remaining(rows)
        held = sum(seq.num_computed_tokens for seq in self._held)
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            queued_prompt_tokens=self._waiting.tokens,
            predicted_remaining_tokens=self._waiting.remaining + int(remaining.sum()),
            kv_blocks_used=self._blocks.num_used_blocks,
            kv_blocks_total=self._blocks.num_blocks,
            cached_tokens=int(computed.sum()) + held,
            iterations=self._iterations,
            num_preemptions=self._num_preemptions,
            kv_blocks_cached=self._blocks.num_cached_blocks,
            by_class=self._class_loads(prio, computed, remaining),
            **self._cache.counters,
        )

    def _running_remaining(self, rows: IntArray) -> IntArray:
        """Sequence.remaining_predicted_tokens of every running row at once (remaining.py)."""
        batch = self._batch
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
        return tuple(
            ClassLoad(
                p,
                self._waiting.count(p),
                self._running_count[p],
                self._preemptions_by_class[p],
                queued_prompt_tokens=self._waiting.tokens_of(p),
                running_tokens=int(running_tokens[p]),
                predicted_remaining_tokens=self._waiting.remaining_of(p)
                + int(running_remaining[p]),
            )
            for p in Priority
        )

    def take_cache_events(self) -> list[CacheEvent]:
        """What changed in the prefix cache since the last call (site_engine/engine/
        prefix_cache.py); empty without prefix caching."""
        return self._blocks.events.take()

    def cache_snapshot(self) -> list[CacheEvent]:
        """Every block id the prefix cache holds now, as BlocksStored events."""
        return self._blocks.snapshot_events()

    def clear_prefix_cache(self) -> None:
        """Forget every cached block id (after a failed step, whose KV may be incomplete)."""
        self._blocks.clear_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if queues, sequences and block tables disagree (used by tests)."""
        self._blocks.check_invariants()
        self._batch.check()
        for seq in self._running:
            row = seq.row
            if row < 0 or self._batch.seqs[row] is not seq:
                raise AssertionError(f"running {seq.request_id!r} holds no row")
            if int(self._batch.held[row]) != self._blocks.num_held(seq.request_id):
                raise AssertionError(f"running {seq.request_id!r}: row's block count is stale")
        if self._batch.size != len(self._running):
            raise AssertionError("running batch size out of step with the running list")
        self._waiting.check()
        if Counter(seq.priority for seq in self._running) != +Counter(self._running_count):
            raise AssertionError(f"running counts {self._running_count} out of step")
        holders = {seq.request_id for seq in (*self._running, *self._held)}
        if self._slots is not None:
            self._slots.check()
        tables = {t for t in self._blocks.request_ids() if not is_adapter_table(t)}
        if holders != tables:
            raise AssertionError(
                f"tables {sorted(self._blocks.request_ids())} != holders {sorted(holders)}"
            )
        if len(self._running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self._running)} running > max_num_seqs")
        for seq in self._waiting:
            if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
                raise AssertionError(f"waiting {seq.request_id!r}: {seq.status}, computed>0")
        for seq in self._running:
            capacity = len(self._blocks.block_table(seq.request_id)) * self.config.block_size
            if not seq.num_computed_tokens < seq.num_tokens or seq.num_computed_tokens > capacity:
                raise AssertionError(f"running {seq.request_id!r}: bad computed/capacity")
        live = {seq.request_id for seq in (*self._waiting, *self._running)}
        if live != set(self._live):
            raise AssertionError("live index out of step with the queues")
        if self._blocks.caching:
            for seq in (*self._running, *self._held):
                self._cache.check(seq)
