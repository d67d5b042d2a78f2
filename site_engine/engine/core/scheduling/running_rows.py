"""The running rows' planner: a class's running sequences in the step being planned, its decodes
in bulk before its prefill chunks, so that a long prefill cannot starve the decodes of its class
of the step's token budget.

A decode is an array operation over the rows; Python runs per row only where a row crosses a
block boundary with no free block left, and for background decodes while the step's background
time is bounded (step_budget.py). KV growth preempts the lowest class first, the newest of it,
`seq` itself before any of a higher class (class_preemption.py).
"""

from __future__ import annotations

import numpy as np

from fedllm_contract.priority import Priority
from site_engine.engine.core.running_batch import IntArray
from site_engine.engine.core.scheduling.roster import Roster
from site_engine.engine.core.scheduling.step_plan import StepPlan
from site_engine.engine.core.sequence import Sequence


class RunningRows:
    """Plans the step's work of the sequences already running."""

    def __init__(self, roster: Roster) -> None:
        self._roster = roster
        self._block_size = roster.config.block_size

    def plan(self, priority: Priority, plan: StepPlan) -> None:
        """Schedule the running sequences of one class: its decodes in bulk (one token each for
        every row whose only uncomputed token is the one it sampled last), then its prefill
        chunks in admission order."""
        roster = self._roster
        if roster.running_count[priority] == 0:
            return
        batch = roster.batch
        rows = batch.rows_of(priority)
        computed, tokens = batch.computed[rows], batch.tokens[rows]
        live = tokens < batch.limit[rows]  # done but for pending tokens: its last step retires it
        wanted = tokens - computed
        decode = live & (wanted == 1) & batch.fed[rows]
        prefill = rows[live & ~decode & (wanted > 0)]
        decodes = rows[decode]
        if decodes.size:
            if priority.is_background and plan.budget.timed:
                self._timed_decodes(decodes, plan)
            else:
                self._decodes(decodes, plan)
        if prefill.size:
            for row in batch.by_order(prefill).tolist():
                seq = batch.seqs[row]
                if seq is None:
                    continue  # preempted for an earlier one's growth
                if not self._prefill(seq, plan):
                    break  # `seq` itself was the last one of its class and got preempted

    def _decodes(self, rows: IntArray, plan: StepPlan) -> None:
        """One token for each of `rows` (a decode, never deferred: only the step's budget
        bounds it), the oldest first if the budget cannot take them all; a new block for the
        rows whose token starts one."""
        batch, budget = self._roster.batch, plan.budget
        if rows.size > budget.tokens:
            rows = batch.by_order(rows)[: max(budget.tokens, 0)]
        grow = rows[batch.computed[rows] >= batch.held[rows] * self._block_size]
        if grow.size:
            ordered = batch.by_order(grow)
            given = self._roster.blocks.grow_by_one(batch.pick(batch.ids, ordered))
            if given:
                grown = ordered[: len(given)]
                plan.table_parts.append((grown, batch.held[grown], np.array(given)))
                batch.held[grown] += 1
                batch.synced[grown] += 1  # told the runner with this step's table delta
            # Out of free blocks: the rest one at a time, preempting the newest for room.
            for row in ordered[len(given) :].tolist():
                seq = batch.seqs[row]
                if seq is None:
                    continue  # preempted for an older one's block
                if not self._grow(seq, int(batch.computed[row]) + 1, plan):
                    break  # `seq` and everything newer of its class were preempted
            # A victim's row is free now (no admission takes it before this class's decodes).
            rows = rows[batch.active[rows]]
        if rows.size:
            plan.decode(rows)
            budget.tokens -= int(rows.size)
            budget.context += int(batch.computed[rows].sum())

    def _timed_decodes(self, rows: IntArray, plan: StepPlan) -> None:
        """Background decodes while the step's background time is bounded (step_budget.py):
        in admission order, each while its time fits, one at a time."""
        batch, budget = self._roster.batch, plan.budget
        for row in batch.by_order(rows).tolist():
            seq = batch.seqs[row]
            if seq is None:
                continue
            if budget.allowance(seq, 1) < 1:
                continue  # waits, keeping its blocks, for a step with room
            computed = int(batch.computed[row])
            if computed >= int(batch.held[row]) * self._block_size and not self._grow(
                seq, computed + 1, plan
            ):
                break
            plan.decode(np.array([row], dtype=np.int64))
            budget.take(seq, 1, 1)

    def _prefill(self, seq: Sequence, plan: StepPlan) -> bool:
        """The next prefill chunk of running `seq` as its budget allows; False if `seq` had to
        be preempted for its blocks."""
        budget = plan.budget
        wanted = seq.num_tokens - seq.num_computed_tokens
        num_new = budget.allowance(seq, wanted)
        if num_new <= 0:
            return True
        num_total = seq.num_computed_tokens + num_new
        if not self._grow(seq, num_total, plan):
            return False
        plan.chunk(seq, num_new)
        budget.take(seq, wanted, num_new)
        return True

    def _grow(self, seq: Sequence, num_tokens_total: int, plan: StepPlan) -> bool:
        """Grow `seq`'s table to `num_tokens_total` slots, preempting running sequences (the
        lowest class first, the newest of it first, never one of a higher class than `seq`) as
        long as needed. Returns False if `seq` had to be preempted itself."""
        roster = self._roster
        blocks = roster.blocks
        while not blocks.try_grow(seq.request_id, num_tokens_total):
            if roster.evict_idle_adapter(()):
                continue  # an idle adapter's blocks before any sequence's
            victim = roster.victim(seq.priority)
            assert victim is not None  # `seq` itself qualifies
            plan.preempt(victim)
            if victim is seq:
                return False
        row = seq.row
        roster.batch.held[row] = blocks.num_held(seq.request_id)
        plan.grown.add(row)
        return True
