"""The iteration-level (continuous batching) scheduler: the façade the engine and the simulator
drive, which orders a step over the parts that own its state and its decisions.

Each step: running sequences first (one decode token each, or their next prefill chunk), then
waiting ones are admitted in policy order while the sequence limit, the per-step token budget and
the KV budget allow (admission.py). A finished sequence is retired in the same `update` and its
blocks return at once (results.py).

Priority classes (fedllm_contract/priority.py: interactive > flex > batch): a step is planned
class by class from the top, each class's running sequences (running_rows.py) and then its
admissions, so a higher class takes the step's token budget first. The background classes'
prefill per step is bounded (step_budget.py, the deferral bound).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from fedllm_contract.block_hash import root_hash
from fedllm_contract.cache_events import CacheEvent
from fedllm_contract.priority import Priority
from site_engine.engine.core.block_manager import BlockManager
from site_engine.engine.core.outputs import StepOutputs
from site_engine.engine.core.scheduler_config import SchedulerConfig, SchedulerStats
from site_engine.engine.core.scheduling.adapter_gate import AdapterGate
from site_engine.engine.core.scheduling.admission import Admission
from site_engine.engine.core.scheduling.results import Results
from site_engine.engine.core.scheduling.roster import Roster
from site_engine.engine.core.scheduling.running_rows import RunningRows
from site_engine.engine.core.scheduling.step_plan import StepPlan
from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.step_budget import StepBudget
from site_engine.engine.core.step_cost import StepCost, StepCostModel
from site_engine.engine.core.types import (
    FinishReason,
    Guide,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from site_engine.engine.core.unified_slots import UnifiedSlots, is_adapter_table


class Scheduler:
    """Decides each step's batch and keeps every sequence's KV blocks in step with it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._roster = Roster(config)
        self._gate = AdapterGate(self._roster)
        self._admission = Admission(self._roster, self._gate)
        self._running_rows = RunningRows(self._roster)
        self._results = Results(self._roster)
        self._step_cost = StepCostModel()
        self._next_step_id = 1
        self._iterations = 0

    @property
    def block_manager(self) -> BlockManager:
        """The cache's bookkeeping (the idle-memory lending works on it: core/kv_lending.py)."""
        return self._roster.blocks

    @property
    def unified_slots(self) -> UnifiedSlots | None:
        """The adapter slots in the KV pool (None: fixed slots)."""
        return self._roster.slots

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
        seq.cache_salt = cache_salt
        if self.config.prefix_caching:
            seq.root_hash = root_hash(self.config.model_name, cache_salt, adapter)
        self._roster.enroll(seq)
        return seq

    def set_guide(self, request_id: str, guide: Guide) -> None:
        """The grammar of a request added `awaiting_guide` is ready: it may be admitted."""
        seq = self._roster.live[request_id]
        if not seq.awaiting_guide:
            raise ValueError(f"request {request_id!r} is not waiting for its grammar")
        seq.guide = guide
        seq.awaiting_guide = False

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """Retire a live sequence now (cancel, stop string) and free its blocks.

        False, with nothing changed, for an unknown or already finished id.
        """
        seq = self._roster.live.get(request_id)
        if seq is None:
            return False
        self._roster.retire(seq, reason)
        self._roster.end_static_batch_if_done()
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
            for seq in self._roster.waiting
            if not seq.ever_scheduled and seq.releasable and not seq.awaiting_guide
        ]
        released = fresh[-max_requests:]
        for seq in released:
            self._roster.retire(seq, FinishReason.RELEASED)
        return released

    def get(self, request_id: str) -> Sequence | None:
        """The live (waiting or running) sequence with this id, if any."""
        return self._roster.live.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._roster.live)

    def queue_lengths(self) -> tuple[int, int]:
        """(waiting, running) sequences: stats() without its walk over every sequence."""
        return len(self._roster.waiting), len(self._roster.running)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step, class by class from interactive down: each class's running
        sequences (its decodes in bulk, then its prefill chunks), then its admissions, so a
        higher class takes the step's budget first."""
        cfg, roster = self.config, self._roster
        budget = StepBudget.for_step(
            cfg.max_num_batched_tokens,
            cfg.background_step_tokens,
            self._step_cost.current,
            cfg.background_step_slack,
        )
        plan = StepPlan(roster, budget)
        step_id = self._next_step_id
        # A class whose waiting sequences change during this step (a victim joins them) admits
        # nobody in it, by the rule below: the class's queue is as it was when the step began.
        self._gate.begin_step(step_id)
        for priority in Priority:
            self._running_rows.plan(priority, plan)
            roster.end_static_batch_if_done()
            # Admitting right after a preemption of this class or a higher one would only
            # thrash: the victim's blocks are needed by sequences that outrank the candidates.
            # Victims of a lower class (taken to admit a higher one) do not hold it back.
            if any(victim.priority <= priority for victim in plan.preempted):
                continue
            if not (roster.static and roster.running):
                self._admission.admit(priority, plan)
            if priority is Priority.INTERACTIVE:
                # One left waiting that is ready (not compiling a grammar or loading an adapter)
                # is held up by a slot or blocks: background work must not slow the step more.
                waiting = any(
                    not (seq.awaiting_guide or seq.awaiting_adapter)
                    for seq in roster.waiting.of_class(priority)
                )
                rows = roster.running_count[priority]
                budget.interactive_planned(rows, waiting, cfg.max_num_seqs)
        self._gate.end_step()
        left = frozenset(roster.left_since_step) | {victim.request_id for victim in plan.preempted}
        roster.left_since_step.clear()
        decodes = np.flatnonzero(plan.decoding)
        if plan.chunks or decodes.size:
            self._iterations += 1
        self._next_step_id += 1
        self._results.launched(step_id, plan.unsampled)
        copies = roster.cache.take_copies(cfg.max_blocks_per_step, step_id)
        return plan.output(step_id, decodes, left, copies)

    def advance_guides(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Moves the grammars of `output`'s constrained rows past the tokens it sampled, before
        `update`: the next step's masks read them, and can fill on another thread while the
        rest of the update (every row's bookkeeping) runs (PagedEngine._step). `update` of the
        same step takes these verdicts instead of advancing again."""
        self._results.advance_guides(output, result)

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> StepOutputs:
        """Apply a step's results: resolve its pending tokens and retire the sequences that
        finished (their blocks are free when this returns, except in static mode); the step's
        outputs, one entry per sampled sequence still here (a token, maybe a finish).

        Steps must be updated once each, in the order they were scheduled. Rows of sequences
        that left since `schedule` (cancelled, or finished by an earlier step) are ignored; a
        sequence preempted since still gets its token.
        """
        return self._results.update(output, result)

    def evict_idle_adapters(self) -> int:
        """Unified slots: every idle adapter gives its blocks back (before the cache's top is
        lent: kv_lending.py lends only free blocks, and an adapter's may sit there); how many."""
        return self._gate.evict_idle_adapters()

    def drop_adapter(self, adapter: str) -> None:
        """`adapter` is no longer served (it has no live request): its slot's blocks go back."""
        if self._roster.slots is not None:
            self._roster.slots.drop(adapter)

    def adapter_loaded(self, adapter: str) -> None:
        """`adapter` is in host memory: the requests that wait for it may be admitted."""
        self._gate.adapter_loaded(adapter)

    def awaiting_adapter(self, adapter: str) -> list[str]:
        """The requests waiting for `adapter` to load."""
        return self._gate.awaiting_adapter(adapter)

    def live_adapters(self) -> set[str]:
        """The adapters of the requests waiting or running now."""
        return {seq.adapter for seq in self._roster.live.values() if seq.adapter}

    def stats(self) -> SchedulerStats:
        return self._roster.stats(self._iterations)

    def take_cache_events(self) -> list[CacheEvent]:
        """What changed in the prefix cache since the last call (site_engine/engine/
        prefix_cache.py); empty without prefix caching."""
        return self._roster.blocks.events.take()

    def cache_snapshot(self) -> list[CacheEvent]:
        """Every block id the prefix cache holds now, as BlocksStored events."""
        return self._roster.blocks.snapshot_events()

    def clear_prefix_cache(self) -> None:
        """Forget every cached block id (after a failed step, whose KV may be incomplete)."""
        self._roster.blocks.clear_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if queues, sequences and block tables disagree (used by tests)."""
        self._roster.check()
