"""One step while it is planned, made fresh by each `Scheduler.schedule`: its token budget, the
chunks and decodes given so far, the sequences preempted for it, and what the model runner is to
be told of it as deltas (rows that joined, blocks added to rows' tables, decode rows as arrays).

Host work per step (issue 66): a running sequence's numbers live in a row of the running batch,
so the common step, every decoding sequence one more token, is planned with array operations over
the rows. A decode or chunk given here counts as computed at once and its sampled token as
pending (async scheduling: the next step may be planned while this one runs on the device).
"""

from __future__ import annotations

import numpy as np

from site_engine.engine.core.block_manager import CopyPlan
from site_engine.engine.core.running_batch import IntArray
from site_engine.engine.core.scheduling.roster import Roster
from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.step_budget import StepBudget
from site_engine.engine.core.types import RowJoin, ScheduledChunk, SchedulerOutput

_NO_DELTA = (np.zeros(0, dtype=np.int64),) * 3
# A chunk's planning key: its class, then its admission order (SchedulerOutput.chunks sorts by it).
_CLASS_KEY = 1 << 48


class StepPlan:
    """The step being planned: what it runs, and what changed in the rows for it."""

    __slots__ = (
        "_roster",
        "budget",
        "chunks",
        "decoding",
        "grown",
        "joined",
        "preempted",
        "table_parts",
        "unsampled",
    )

    def __init__(self, roster: Roster, budget: StepBudget) -> None:
        self._roster = roster
        self.budget = budget
        self.chunks: list[ScheduledChunk] = []
        self.preempted: list[Sequence] = []
        # Rows given a decode; rows taken and tables grown (SchedulerOutput.joined, table_delta).
        self.decoding = np.zeros(roster.batch.capacity, dtype=np.bool_)
        self.joined: list[RowJoin] = []
        self.grown: set[int] = set()
        # Blocks added in bulk: (rows, positions in their tables, blocks).
        self.table_parts: list[tuple[IntArray, IntArray, IntArray]] = []
        # Sequences given a chunk that samples nothing (a prefill chunk short of the end): the
        # step's update registers their filled blocks without a pass over every chunk.
        self.unsampled: list[str] = []

    def decode(self, rows: IntArray) -> None:
        """`rows` decode in this step: one more position computed, one more token sampled."""
        batch = self._roster.batch
        batch.computed[rows] += 1
        batch.tokens[rows] += 1
        batch.pending[rows] += 1
        self.decoding[rows] = True

    def preempt(self, seq: Sequence) -> None:
        """`seq` is preempted for this step (roster.preempt), its decode in it taken back."""
        batch = self._roster.batch
        row = seq.row
        if self.decoding[row]:
            # Its decode was planned in this step already (decodes go first): taken back.
            self.decoding[row] = False
            total = int(batch.computed[row])
            batch.computed[row] -= 1
            batch.tokens[row] -= 1
            batch.pending[row] -= 1
            self.budget.tokens += 1
            self.budget.context -= total
        self._roster.preempt(seq)
        self.preempted.append(seq)

    def joins(self, seq: Sequence, row: int) -> None:
        """An admitted `seq` took `row`: the model runner hears of it with this step."""
        self.grown.add(row)
        self.joined.append(
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

    def chunk(self, seq: Sequence, num_new: int) -> None:
        """The prefill chunk of `seq`'s next `num_new` positions (all of them known tokens: a
        row that sampled decodes instead); they count as computed from now on."""
        roster = self._roster
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
            block_table=roster.blocks.block_table(seq.request_id),
            sample=end == num_prompt + num_output,
            sampling=seq.sampling,
            num_generated=num_output,
            guide=seq.guide,
            history=output if penalized else (),
            prompt_token_ids=seq.prompt_token_ids if penalized else (),
            adapter=seq.adapter,
            row=row,
        )
        batch = roster.batch
        batch.computed[row] = end
        if start < num_prompt:
            roster.cache.computed(seq, start, end)
        if chunk.sample:
            batch.pending[row] += 1
            batch.tokens[row] += 1
            batch.fed[row] = True
        else:
            self.unsampled.append(seq.request_id)
        self.chunks.append(chunk)

    def output(
        self, step_id: int, decodes: IntArray, left: frozenset[str], copies: CopyPlan
    ) -> SchedulerOutput:
        """The planned step as the model runner is told it."""
        roster = self._roster
        batch = roster.batch
        chunks = self.chunks
        slots = roster.slots
        return SchedulerOutput(
            prefill_chunks=tuple(chunks),
            prefill_serials=tuple(batch.serial[[c.row for c in chunks]].tolist()),
            finished_request_ids=left,
            preempted_request_ids=frozenset(victim.request_id for victim in self.preempted),
            step_id=step_id,
            kv_copies=copies.copies,
            kv_copies_before_step=copies.before_step,
            kv_copies_wait_for_step=copies.wait_for_step,
            num_tokens=self.budget.scheduled_tokens,
            context_tokens=self.budget.context,
            decode_rows=decodes,
            decode_positions=batch.computed[decodes] - 1,
            decode_generated=batch.tokens[decodes] - 1 - batch.prompt_len[decodes],
            decode_serials=batch.serial[decodes],
            decode_pending=batch.pending[decodes] > 1,
            decode_tables=batch.held[decodes],
            decode_seqs=batch.pick(batch.seqs, decodes),  # type: ignore[arg-type]
            joined=tuple(self.joined),
            table_delta=self._table_delta(),
            special_decodes=tuple(np.flatnonzero(batch.guided[decodes]).tolist()),
            decode_keys=batch.prio[decodes] * _CLASS_KEY + batch.order[decodes],
            prefill_keys=self._prefill_keys(),
            table_of=roster.blocks.table_if_held,
            adapter_slots=None if slots is None else slots.take_mapping(),
        )

    def _prefill_keys(self) -> tuple[int, ...]:
        """Each prefill chunk's planning key (SchedulerOutput.chunks sorts by it)."""
        if not self.chunks:
            return ()
        batch, rows = self._roster.batch, [chunk.row for chunk in self.chunks]
        return tuple((batch.prio[rows] * _CLASS_KEY + batch.order[rows]).tolist())

    def _table_delta(self) -> tuple[IntArray, IntArray, IntArray]:
        """The blocks added to running rows' tables for this step, as (rows, positions in their
        tables, blocks)."""
        parts = self.table_parts
        if self.grown:
            batch, blocks = self._roster.batch, self._roster.blocks
            rows: list[int] = []
            cols: list[int] = []
            added: list[int] = []
            for row in sorted(self.grown):
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
