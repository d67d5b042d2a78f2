"""Admission with MICO's prediction-aware plan (adaptive batch size), one class at a time.

A candidate is admitted only if, planning every running sequence at its expected total length
(prompt + predicted output, or + max_tokens without a prediction; never less than what it holds
now) plus the candidate at its expected total, the plan fits in the cache minus a watermark.
Blocks are allocated only for tokens actually computed, so a good prediction admits more
sequences than max_tokens would, and a bad one is corrected by recompute preemption: the most
recently admitted running sequence gives its blocks back and re-prefills prompt + generated
tokens later. When nothing runs, the head of the queue is admitted regardless of the plan, which
(with the size check at `add`) guarantees progress.

A class's plan counts the holders of its class and higher ones only; when a candidate needs a
batch slot or blocks now, running sequences of lower classes are preempted (class_preemption.py),
never of its own or a higher one, which it waits for. With prefix caching the candidate's longest
cached chain of full blocks is shared instead of computed (never its last token: its logits are
needed), only the uncached tokens count against the step's budget, and a block running sequences
already hold counts once in the plan.
"""

from __future__ import annotations

import numpy as np

from fedllm_contract.priority import Priority
from site_engine.engine.core.block_manager import CacheHit
from site_engine.engine.core.class_preemption import room_without
from site_engine.engine.core.scheduling.adapter_gate import SKIP, AdapterGate
from site_engine.engine.core.scheduling.roster import Roster
from site_engine.engine.core.scheduling.step_plan import StepPlan
from site_engine.engine.core.sequence import Sequence, SequenceStatus


class Admission:
    """Admits a class's waiting sequences into the step being planned while they fit."""

    def __init__(self, roster: Roster, gate: AdapterGate) -> None:
        self._roster = roster
        self._gate = gate

    def admit(self, priority: Priority, plan: StepPlan) -> None:
        """Admit the waiting sequences of one class in policy order while they fit, preempting
        running sequences of lower classes for a batch slot or KV blocks."""
        roster, cfg = self._roster, self._roster.config
        candidates = roster.waiting.of_class(priority)  # only admissions below change it
        if not candidates:
            return
        if len(roster.running) >= cfg.max_num_seqs and not roster.runs_below(priority):
            return  # skip planning when nobody can be admitted anyway
        plan_limit = cfg.num_blocks - cfg.watermark_blocks
        planned, outranking = self._planned_for(priority)
        admitted = 0
        budget, static = plan.budget, roster.static
        for index, seq in enumerate(candidates):
            # A static batch may take members beyond this step's token budget: they prefill in
            # later steps, as members of the same batch.
            if budget.tokens == 0 and not static:
                break
            if seq.awaiting_guide:
                continue  # not ready: it does not hold up the requests behind it
            adapter_blocks = self._gate.answer(seq, candidates, index) if seq.adapter else 0
            if adapter_blocks < 0:
                if adapter_blocks == SKIP:
                    continue
                break
            if seq.num_pending:
                break  # preempted with a token still on the device: re-prefill needs its value
            hit = roster.cache.lookup(seq)
            need = self._planned_blocks(seq) - roster.blocks.shared_in_use(hit) + adapter_blocks
            # The plan counts this class and higher ones only: a lower class's expected growth
            # does not hold a higher class back (its sequences are preempted if KV runs out).
            if outranking and planned + need > plan_limit:
                break  # strict policy order: nobody overtakes a candidate that does not fit
            if not self._start(seq, hit, plan):
                break
            planned += need
            outranking = True
            admitted += 1
        roster.waiting.drop_admitted(priority, admitted)

    def _start(self, seq: Sequence, hit: CacheHit, plan: StepPlan) -> bool:
        """`seq` starts running with its cache `hit` and its first chunk if the step's budget
        and the cache have room for them (made by preempting lower classes if need be)."""
        roster, budget = self._roster, plan.budget
        cached = hit.num_blocks * roster.config.block_size
        wanted = seq.num_tokens - cached
        num_new = budget.allowance(seq, wanted, cached)
        if num_new == 0 and not roster.static:
            return False  # the deferral bound: this background prefill waits for a later step
        # Blocks copied back from the host tier: the copies overlap this step, the sequence
        # computes from the next one (which waits for them) and this step waits for no copy
        # (vLLM's asynchronous KV loads). Static batches keep their own rule.
        onload = bool(hit.host_slots) and not roster.static
        if onload:
            num_new = 0
        # A victim's freed blocks stay indexed, so `hit` holds after preemptions.
        total = cached + num_new
        if not roster.has_room(hit, total) and not (
            roster.room_from_idle_adapters(seq, hit, total)
            or self._evict_below(seq.priority, hit, total, plan)
        ):
            return False
        plan.joins(seq, roster.admit(seq, hit, total, onload))
        if num_new > 0:
            plan.chunk(seq, num_new)
            budget.take(seq, wanted, num_new)
        return True

    def _evict_below(
        self, priority: Priority, hit: CacheHit, num_tokens_total: int, plan: StepPlan
    ) -> bool:
        """Preempt running sequences of classes below `priority` (the lowest class first, the
        newest of it first) until the candidate admitted with `hit` has a batch slot and blocks
        for its first chunk. False, having preempted none, if preempting them all would not
        make that room: a victim that could not help would only lose its work."""
        roster = self._roster
        if not roster.runs_below(priority):
            return False
        lower = [victim for victim in roster.running if victim.priority > priority]
        seats = len(roster.running) - len(lower) < roster.config.max_num_seqs
        if not (lower and seats and room_without(roster.blocks, lower, hit, num_tokens_total)):
            return False
        while not roster.has_room(hit, num_tokens_total):
            victim = roster.victim(priority + 1)
            assert victim is not None  # preempting all of `lower` makes room
            plan.preempt(victim)
        return True

    def _planned_for(self, priority: Priority) -> tuple[int, bool]:
        """Blocks the admission plan of class `priority` counts as taken: those held now (a
        shared one once) plus what each holder is still planned to grow by, leaving out the
        holders of lower classes; and whether any holder of this class or a higher one runs.

        A block a lower class shares with a higher one is left out too: the plan errs towards
        admitting, and the admission's real check (`Roster.has_room`) is exact."""
        roster = self._roster
        blocks, batch = roster.blocks, roster.batch
        planned = blocks.num_used_blocks
        if roster.slots is not None:
            # Idle adapters give their blocks back before a sequence waits for them.
            planned -= roster.slots.idle_blocks(roster.running_adapters.keys())
        size = roster.config.block_size
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
        for seq in roster.held:  # static mode: finished members still holding blocks
            count = blocks.num_held(seq.request_id)
            if seq.priority > priority:
                planned -= count
                continue
            tokens_held = max(seq.expected_total_tokens, seq.num_tokens)
            planned += max(-(-tokens_held // size) - count, 0)
            outranking = True
        return max(planned, 0), outranking

    def _planned_blocks(self, seq: Sequence) -> int:
        """Blocks the admission plan reserves for `seq`: its expected total, or more if it
        already needs more (it outran its prediction, or it is a preempted one coming back)."""
        blocks = self._roster.blocks
        tokens = max(seq.expected_total_tokens, seq.num_tokens)
        held = 0 if seq.status is SequenceStatus.WAITING else blocks.num_held(seq.request_id)
        return max(blocks.blocks_needed(tokens), held)
