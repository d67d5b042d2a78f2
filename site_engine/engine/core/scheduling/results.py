"""Result application: a step's sampled tokens applied to the sequences they were planned for,
the finished ones retired in the same update (their blocks return at once, so a waiting one can
start at the very next step).

Async scheduling: a step's chunks count as computed as soon as they are scheduled and its
sampled tokens as pending, so the next step can be scheduled while this one still runs on the
device (the runner feeds pending tokens from the device). Updates must then come in the order
the steps were scheduled; each resolves its pending tokens. A sequence that finishes on EOS
therefore computes one extra token that is thrown away; one that reaches max_tokens is never
scheduled past it. Called strictly as schedule -> update -> schedule, nothing is ever pending
when a step is scheduled.

Prefix caching: full blocks are indexed here, once the step that writes their KV is launched and
their tokens are known (a generated block's last token may still be on the device when its KV is
scheduled). A block indexed while that step still runs on the device is safe to share: every
later step is queued behind it.

The common update, a token for each decode row, is applied in bulk: the tokens appended and the
finished rows found by vectorized checks; Python runs per row only for a finish, a grammar or a
row whose sequence left since the step was planned.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from site_engine.engine.core.outputs import NO_TOKEN, StepOutputs
from site_engine.engine.core.running_batch import IntArray
from site_engine.engine.core.scheduling.roster import Roster
from site_engine.engine.core.sequence import Sequence, SequenceStatus
from site_engine.engine.core.types import FinishReason, ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)

Verdicts = dict[str, FinishReason | None]
Filled = list[tuple[Sequence, int]]
Finishing = list[tuple[Sequence, FinishReason]]


class Results:
    """Applies each step's results, in the order the steps were scheduled."""

    def __init__(self, roster: Roster) -> None:
        self._roster = roster
        self._eos = np.array(sorted(roster.config.eos_token_ids), dtype=np.int64)
        # The steps scheduled and not yet updated, oldest first (results come back in order; a
        # row's serial, not its request id, tells a late result from a new occupant's).
        self._in_flight: dict[int, None] = {}
        # Each step in flight's sequences given a chunk that samples nothing: `update`
        # registers their filled blocks without a pass over every chunk of the step.
        self._unsampled_by_step: dict[int, list[str]] = {}
        # advance_guides' verdicts (step id, request id -> finish reason), taken by `update`.
        self._guided: tuple[int, Verdicts] | None = None

    def launched(self, step_id: int, unsampled: list[str]) -> None:
        """Step `step_id` was scheduled: its results are awaited next after those before it."""
        self._in_flight[step_id] = None
        if unsampled:
            self._unsampled_by_step[step_id] = unsampled

    def advance_guides(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Moves the grammars of `output`'s constrained rows past the tokens it sampled, before
        `update` (Scheduler.advance_guides)."""
        oldest = next(iter(self._in_flight), None)
        if output.step_id != oldest:
            raise ValueError(f"step {output.step_id} is not the oldest awaiting results ({oldest})")
        tokens = self._sampled_tokens(output, result)
        verdicts: Verdicts = {}
        for index, seq in self._guided_entries(output):
            verdicts[seq.request_id] = self._advance_guide(seq, int(tokens[index]))
        self._guided = (output.step_id, verdicts)

    def _guided_entries(self, output: SchedulerOutput) -> list[tuple[int, Sequence]]:
        """(sample index, sequence) of the step's constrained rows still running as planned."""
        batch = self._roster.batch
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
        live = self._roster.live
        missing = [rid for rid in ids if rid not in sampled and rid in live]
        if missing:
            raise ValueError(f"no sampled token for request(s) {sorted(missing)}")
        return np.array([sampled.get(rid, NO_TOKEN) for rid in ids], dtype=np.int64)

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> StepOutputs:
        """Apply a step's results (Scheduler.update)."""
        oldest = next(iter(self._in_flight), None)
        if output.step_id != oldest:
            raise ValueError(
                f"step {output.step_id} is not the oldest step awaiting results ({oldest}); "
                "was update() applied twice, out of order, or to a stale SchedulerOutput?"
            )
        tokens = self._sampled_tokens(output, result)
        del self._in_flight[output.step_id]
        guided: Verdicts = {}
        if self._guided is not None and self._guided[0] == output.step_id:
            guided = self._guided[1]
        self._guided = None
        outputs = StepOutputs()
        # Sequences with blocks to index, registered together (SequenceCache.register_all)
        # before any retirement frees blocks; the sequences that finished, in order.
        filled = self._unsampled_filled(output.step_id)
        finishing: Finishing = []
        count = output.num_decodes
        if count:
            self._apply_decodes(output, tokens[:count], guided, outputs, filled, finishing)
        index = count
        for chunk, serial in zip(output.prefill_chunks, output.prefill_serials, strict=True):
            if chunk.sample:
                token = int(tokens[index])
                self._apply_token(chunk.row, serial, token, guided, outputs, filled, finishing)
                index += 1
        roster = self._roster
        if filled:
            roster.cache.register_all(filled)
        for seq, reason in finishing:
            roster.retire(seq, reason)
        roster.end_static_batch_if_done()
        return outputs

    def _unsampled_filled(self, step_id: int) -> Filled:
        """The sequences whose prefill chunks of step `step_id` sampled nothing and filled a
        block: indexed only now, once the step that writes them is launched (a block indexed in
        `schedule` could be hit by a chunk of the same step, which the runner may run before
        the chunk that writes it)."""
        unsampled = self._unsampled_by_step.pop(step_id, ())
        roster = self._roster
        if not roster.blocks.caching:
            return []
        filled: Filled = []
        for request_id in unsampled:
            seq = roster.live.get(request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_computed_tokens >= seq.next_full_block_at:
                filled.append((seq, roster.cache.full_blocks(seq)))
        return filled

    def _apply_decodes(
        self,
        output: SchedulerOutput,
        tokens: IntArray,
        guided: Verdicts,
        outputs: StepOutputs,
        filled: Filled,
        finishing: Finishing,
    ) -> None:
        """The decode rows' tokens, in bulk for the rows still held by the sequences they were
        planned for; one at a time for the others (preempted since: they keep their token)."""
        roster = self._roster
        batch = roster.batch
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
        if roster.blocks.caching:
            fill = np.flatnonzero(batch.computed[rows] >= batch.next_full[rows])
            if fill.size:
                # SequenceCache.full_blocks of every filled row at once.
                size = roster.config.block_size
                fill_rows = rows[fill]
                known = batch.tokens[fill_rows] - batch.pending[fill_rows]
                num_full = np.minimum(batch.computed[fill_rows], known) // size
                batch.next_full[fill_rows] = (num_full + 1) * size
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
        guided: Verdicts,
        outputs: StepOutputs,
        filled: Filled,
        finishing: Finishing,
    ) -> None:
        """One sampled token of the row that had `serial` when planned: its sequence's, if it
        still runs there or was preempted since (then it waits and still gets the token)."""
        roster = self._roster
        batch = roster.batch
        if row >= 0 and batch.serial[row] == serial:
            seq = batch.seqs[row]
            assert seq is not None
            batch.pending[row] -= 1
        else:
            orphans = roster.orphans
            orphan = orphans.get(serial)
            if orphan is None:
                return  # it left the engine: its late tokens are no one's
            if roster.live.get(orphan.request_id) is not orphan:
                del orphans[serial]
                return
            seq = orphan
            seq.num_pending -= 1
            if not seq.num_pending:
                del orphans[serial]
        seq.output_token_ids.append(token)
        if len(seq.output_token_ids) > 1:
            outputs.decoded += 1
        running = seq.status is SequenceStatus.RUNNING
        if roster.blocks.caching and running and seq.num_computed_tokens >= seq.next_full_block_at:
            filled.append((seq, roster.cache.full_blocks(seq)))
        reason = self._reason(seq, token, guided)
        index = outputs.add(seq.request_id, token, source=seq)
        if reason is not None:
            finishing.append((seq, reason))
            outputs.finish(index, reason, seq.error)
            if reason is FinishReason.ERROR:
                outputs.drop_token(index)

    def _reason(self, seq: Sequence, token: int, guided: Verdicts) -> FinishReason | None:
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
        if guide is None or token in self._roster.config.eos_token_ids:
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
        cfg = self._roster.config
        if not seq.sampling.ignore_eos and token in cfg.eos_token_ids:
            return FinishReason.STOP
        known = len(seq.output_token_ids)
        if known >= seq.sampling.max_tokens:
            return FinishReason.LENGTH
        if len(seq.prompt_token_ids) + known >= cfg.max_model_len:
            return FinishReason.LENGTH
        return None
