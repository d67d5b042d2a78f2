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
and base requests go on.

"static" is the batch-by-batch baseline: a batch is admitted only when none is running and runs
until its longest member is done; finished members stop computing but keep their blocks until
the batch ends, which is what a padded static batch costs in memory.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable
from itertools import islice

from fedllm_contract.block_hash import root_hash
from fedllm_contract.cache_events import CacheEvent
from fedllm_contract.priority import Priority
from site_engine.engine.core.adapter_slots import adapter_to_drain, outranked
from site_engine.engine.core.block_manager import BlockManager, CacheHit
from site_engine.engine.core.class_preemption import pick_victim, room_without
from site_engine.engine.core.scheduler_config import ClassLoad, SchedulerConfig, SchedulerStats
from site_engine.engine.core.sequence import Sequence, SequenceStatus, SequenceUpdate
from site_engine.engine.core.sequence_cache import SequenceCache
from site_engine.engine.core.step_budget import StepBudget
from site_engine.engine.core.step_cost import StepCost, StepCostModel
from site_engine.engine.core.types import (
    PENDING_TOKEN,
    FinishReason,
    Guide,
    ModelRunnerOutput,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from site_engine.engine.core.waiting_queue import WaitingQueue

__all__ = ["ClassLoad", "Scheduler", "SchedulerConfig", "SchedulerStats"]
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
        self._waiting = WaitingQueue(config.policy, config.spf_aging)
        self._running: list[Sequence] = []  # in admission order: the last one is preempted first
        # How many of `_running` are of each class: whether a class has a victim below it is
        # asked every step, and walking 1,024 running sequences to find none cost the step.
        self._running_count = dict.fromkeys(Priority, 0)
        self._held: list[Sequence] = []  # static mode: finished members still holding blocks
        self._left_since_step: set[str] = set()
        # Request ids of each scheduled step not yet updated, oldest first: such an id cannot be
        # reused until the step's late results can no longer be mistaken for the new request's.
        self._in_flight: dict[int, frozenset[str]] = {}
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
        if (
            rid in self._live
            or rid in self._left_since_step
            or self._blocks.has_table(rid)
            or any(rid in ids for ids in self._in_flight.values())
        ):
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
        sequences, then its admissions, so a higher class takes the step's budget first."""
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        cfg = self.config
        budget = StepBudget.for_step(
            cfg.max_num_batched_tokens,
            cfg.background_step_tokens,
            self._step_cost.current,
            cfg.background_step_slack,
        )
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
        # Nobody waited for a slot: a drained adapter that no longer runs is chosen anew.
        drain = self._drain
        if drain is not None and self._hold is None:
            self._drain = drain if any(seq.adapter == drain for seq in self._running) else None
        left = frozenset(self._left_since_step) | {victim.request_id for victim in preempted}
        self._left_since_step.clear()
        if chunks:
            self._iterations += 1
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight[step_id] = frozenset([chunk.request_id for chunk in chunks])
        if self._unsampled:
            self._unsampled_by_step[step_id] = self._unsampled
            self._unsampled = []
        plan = self._cache.take_copies(self.config.max_blocks_per_step, step_id)
        return SchedulerOutput(
            chunks=tuple(chunks),
            finished_request_ids=left,
            preempted_request_ids=frozenset(victim.request_id for victim in preempted),
            step_id=step_id,
            kv_copies=plan.copies,
            kv_copies_before_step=plan.before_step,
            kv_copies_wait_for_step=plan.wait_for_step,
            num_tokens=budget.scheduled_tokens,
            context_tokens=budget.context,
        )

    def _schedule_running(
        self,
        priority: Priority,
        chunks: list[ScheduledChunk],
        preempted: list[Sequence],
        budget: StepBudget,
    ) -> None:
        """Schedule the running sequences of one class in admission order.

        Run for every running sequence every step, so it reads the sequence's fields directly
        rather than through its properties (the same arithmetic, fewer Python calls)."""
        count = self._running_count[priority]
        if count == 0:
            return
        running = self._running
        # A copy: a preemption below takes sequences out of `_running` while this goes on.
        members = running[:] if count == len(running) else [
            seq for seq in running if seq.priority is priority
        ]  # fmt: skip
        max_model_len = self.config.max_model_len
        blocks = self._blocks
        # Background decodes bounded in time this step go through the budget like prefills.
        fast_decode = not (priority.is_background and budget.timed)
        for seq in members:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an earlier one's growth
            num_output = len(seq.output_token_ids) + seq.num_pending
            num_tokens = len(seq.prompt_token_ids) + num_output
            # Done but for pending tokens: the step that sampled its last token retires it.
            done = num_output >= seq.sampling.max_tokens or num_tokens >= max_model_len
            wanted = 0 if done else num_tokens - seq.num_computed_tokens
            # One token is a decode, never deferred in tokens (step_budget.py): only the step's
            # budget, and the time bound if background rows have one.
            decode = wanted == 1 and fast_decode
            num_new = min(1, budget.tokens) if decode else budget.allowance(seq, wanted)
            if num_new > 0:
                # Most steps grow no table: _make_room (its first call the same) only if not.
                num_total = seq.num_computed_tokens + num_new
                if not blocks.try_grow(seq.request_id, num_total) and not self._make_room(
                    seq, num_total, preempted
                ):
                    break  # `seq` itself was the last one of its class and got preempted
                chunks.append(self._chunk(seq, num_new))
                if decode:
                    budget.tokens -= 1  # what take() does for a decode
                    budget.context += num_total
                else:
                    budget.take(seq, wanted, num_new)

    def _make_room(self, seq: Sequence, num_tokens_total: int, preempted: list[Sequence]) -> bool:
        """Grow `seq`'s table, preempting running sequences (the lowest class first, the newest
        of it first, never one of a higher class than `seq`) as long as needed.

        Returns False if `seq` had to be preempted itself.
        """
        while not self._blocks.try_grow(seq.request_id, num_tokens_total):
            victim = self._victim(seq.priority)
            assert victim is not None  # `seq` itself qualifies
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _victim(self, lowest: int) -> Sequence | None:
        """The running sequence to preempt first among those of class `lowest` or below. It
        was never scheduled in the step being planned: classes are scheduled from the top, and
        within a class in admission order (the victim is the newest)."""
        return pick_victim(self._running, lowest)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: its blocks go back, it re-prefills prompt + generated tokens
        later, ahead of its class (admission_order puts preempted sequences first)."""
        self._running.remove(seq)
        self._running_count[seq.priority] -= 1
        self._blocks.free(seq.request_id)
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
        adapters = {seq.adapter for seq in self._running if seq.adapter}
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
                # As for a grammar, the requests behind it go on, but for one adapter's: while
                # it waits for a slot, that adapter drains and gives its slot up.
                if not seq.awaiting_adapter and self._overtaken_enough(seq):
                    self._hold_adapter(seq, adapters, islice(candidates, index + 1, None))
                continue
            if seq.num_pending:
                break  # preempted with a token still on the device: re-prefill needs its value
            hit = self._cache.lookup(seq)
            need = self._planned_blocks(seq) - self._blocks.shared_in_use(hit)
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
            if not self._has_room(hit, cached + num_new) and not self._evict_below(
                priority, hit, cached + num_new, preempted
            ):
                break
            self._waiting.admitting(seq)
            self._blocks.admit(seq.request_id, hit, cached + num_new, defer_onload=onload)
            self._cache.admitted(seq, hit)
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            seq.ever_scheduled = True
            seq.slot_wait_since = -1  # a preempted one counts its wait afresh
            self._running.append(seq)
            self._running_count[priority] += 1
            if seq.adapter:
                adapters.add(seq.adapter)
            planned += need
            outranking = True
            admitted += 1
            if num_new > 0:
                chunks.append(self._chunk(seq, num_new))
                budget.take(seq, wanted, num_new)
        self._waiting.drop_admitted(priority, admitted)

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
        blocks = self._blocks
        planned = blocks.num_used_blocks
        outranking = False
        size = self.config.block_size
        for seq in (*self._running, *self._held):
            held = blocks.num_held(seq.request_id)
            if seq.priority > priority:
                planned -= held
                continue
            # _planned_blocks of a holder, its properties unrolled: run for every holder.
            num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending
            tokens = max(len(seq.prompt_token_ids) + seq.expected_output_tokens, num_tokens)
            planned += max(-(-tokens // size) - held, 0)
            outranking = True
        return max(planned, 0), outranking

    def _adapter_ready(self, seq: Sequence, running: set[str]) -> bool:
        """Whether `seq`'s adapter (if any) is in host memory and has a device slot to go to:
        the running sequences use at most max_loras distinct adapters, one step's worth."""
        if not seq.adapter:
            return True
        if seq.awaiting_adapter:
            return False
        return seq.adapter in running or len(running) < self.config.max_loras

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
        """The chunk of `seq`'s next `num_new` positions; they count as computed from now on."""
        start = seq.num_computed_tokens
        end = start + num_new
        output = seq.output_token_ids
        num_output = len(output) + seq.num_pending
        num_prompt = len(seq.prompt_token_ids)
        if num_new == 1 and start >= num_prompt:  # a decode: token_ids_between's last cases
            at = start - num_prompt
            token_ids: tuple[int, ...] = (output[at],) if at < len(output) else (PENDING_TOKEN,)
        else:
            token_ids = seq.token_ids_between(start, end)
        penalized = seq.sampling.penalized
        chunk = ScheduledChunk(
            request_id=seq.request_id,
            token_ids=token_ids,
            start_position=start,
            block_table=self._blocks.block_table(seq.request_id),
            sample=end == num_prompt + num_output,
            sampling=seq.sampling,
            num_generated=num_output,
            guide=seq.guide,
            history=output if penalized else (),
            prompt_token_ids=seq.prompt_token_ids if penalized else (),
            adapter=seq.adapter,
        )
        seq.num_computed_tokens = end
        if start < num_prompt:  # a decode computes no prompt token
            self._cache.computed(seq, start, end)
        if chunk.sample:
            seq.num_pending += 1
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
        sampled = result.sampled_token_ids
        verdicts: dict[str, FinishReason | None] = {}
        for chunk in output.chunks:
            seq = self._live.get(chunk.request_id)
            # A missing token is update()'s error to raise.
            if chunk.sample and seq is not None and seq.guide and chunk.request_id in sampled:
                verdicts[chunk.request_id] = self._advance_guide(seq, sampled[chunk.request_id])
        self._guided = (output.step_id, verdicts)

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[SequenceUpdate]:
        """Apply a step's results: resolve its pending tokens and retire the sequences that
        finished (their blocks are free when this returns, except in static mode).

        Steps must be updated once each, in the order they were scheduled. Chunks of sequences
        that left since `schedule` (cancelled, or finished by an earlier step) are ignored.
        """
        oldest = next(iter(self._in_flight), None)
        if output.step_id != oldest:
            raise ValueError(
                f"step {output.step_id} is not the oldest step awaiting results ({oldest}); "
                "was update() applied twice, out of order, or to a stale SchedulerOutput?"
            )
        sampled = result.sampled_token_ids
        chunks = [c for c in output.chunks if c.sample and c.request_id in self._live]
        missing = [c.request_id for c in chunks if c.request_id not in sampled]
        if missing:
            raise ValueError(f"no sampled token for request(s) {sorted(missing)}")
        del self._in_flight[output.step_id]
        guided: dict[str, FinishReason | None] = {}
        if self._guided is not None and self._guided[0] == output.step_id:
            guided = self._guided[1]
        self._guided = None
        caching = self._blocks.caching
        # Sequences with blocks to index, registered together (SequenceCache.register_all),
        # in the order of the calls one by one, each before its retirement frees its blocks.
        filled: list[Sequence] = []
        unsampled = self._unsampled_by_step.pop(output.step_id, ())
        if caching:
            # Indexed only now, once the step that writes them is launched: a block indexed in
            # `schedule` could be hit by a chunk of the same step, which the runner may run
            # before the chunk that writes it (eager prefill before the decode graphs).
            for request_id in unsampled:
                seq = self._live.get(request_id)
                if seq is None or seq.status is not SequenceStatus.RUNNING:
                    continue
                if seq.num_computed_tokens >= seq.next_full_block_at:
                    filled.append(seq)
        updates: list[SequenceUpdate] = []
        for chunk in chunks:
            seq = self._live[chunk.request_id]
            # A preempted sequence (now waiting) still gets the token its last step sampled.
            token = sampled[chunk.request_id]
            seq.num_pending -= 1
            seq.output_token_ids.append(token)
            # Most steps fill no block of a decoding sequence: those skip the call.
            running = seq.status is SequenceStatus.RUNNING
            if caching and running and seq.num_computed_tokens >= seq.next_full_block_at:
                filled.append(seq)
            if chunk.request_id in guided:
                reason = guided[chunk.request_id]
            else:
                reason = self._advance_guide(seq, token) if seq.guide is not None else None
            reason = reason or self._stop_reason(seq, token)
            if reason is not None:
                if filled:
                    self._cache.register_all(filled)
                    filled = []
                self._retire(seq, reason)
            # A token its grammar refused is no part of the answer.
            new = () if reason is FinishReason.ERROR else (token,)
            updates.append(
                SequenceUpdate(
                    seq.request_id, new, reason, seq.num_cached_prompt_tokens, error=seq.error
                )
            )
        if filled:
            self._cache.register_all(filled)
        self._end_static_batch_if_done()
        return updates

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
            self._running.remove(seq)
            self._running_count[seq.priority] -= 1
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
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            queued_prompt_tokens=self._waiting.tokens,
            predicted_remaining_tokens=self._waiting.remaining
            + sum(seq.remaining_predicted_tokens for seq in self._running),
            kv_blocks_used=self._blocks.num_used_blocks,
            kv_blocks_total=self._blocks.num_blocks,
            cached_tokens=sum(s.num_computed_tokens for s in (*self._running, *self._held)),
            iterations=self._iterations,
            num_preemptions=self._num_preemptions,
            kv_blocks_cached=self._blocks.num_cached_blocks,
            by_class=self._class_loads(),
            **self._cache.counters,
        )

    def _class_loads(self) -> tuple[ClassLoad, ...]:
        # Running sequences are at most max_num_seqs: walked; the waiting queue keeps its sums.
        running_tokens: Counter[Priority] = Counter()
        running_remaining: Counter[Priority] = Counter()
        for seq in self._running:
            running_tokens[seq.priority] += seq.num_computed_tokens
            running_remaining[seq.priority] += seq.remaining_predicted_tokens
        return tuple(
            ClassLoad(
                p,
                self._waiting.count(p),
                self._running_count[p],
                self._preemptions_by_class[p],
                queued_prompt_tokens=self._waiting.tokens_of(p),
                running_tokens=running_tokens[p],
                predicted_remaining_tokens=self._waiting.remaining_of(p) + running_remaining[p],
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
        self._waiting.check()
        if Counter(seq.priority for seq in self._running) != +Counter(self._running_count):
            raise AssertionError(f"running counts {self._running_count} out of step")
        holders = {seq.request_id for seq in (*self._running, *self._held)}
        if holders != self._blocks.request_ids():
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
