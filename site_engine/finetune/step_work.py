"""Fine-tuning as training rows beside every serving step (issue 70's "rows" mode): the engine
loop runs one piece of the job's current unit with each step, sized by StepRows
(site_engine/finetune/step_rows.py) to the room the serving batch leaves in the step's token
budget and to what the measured training time allows within `max_training_delay_ms`.

It is IdleWork (site_engine/idle_work.py), so EngineService runs it as it runs the idle units:
on the engine's thread, after the commands just taken (a request that arrived meanwhile is
waiting, and no rows run), with the reserve lent from the KV cache on demand while a job trains
and given back when none is left (EngineService's OnDemandReserve). Paired with
`rows_gate(bound)`: a gate that lets a bounded piece run with every step (FineInfer's rule, no
busy share), while an unmeasured one (the trainer's build) waits as an idle unit does.
The pieces themselves are bounded by the jobs' own time bound (FineTuneSettings.max_step_ms,
within `max_training_delay_ms`; PIECE_SHARE of it where the caller follows this module): a unit
of many rows, or one example longer than the rows, is run over several steps, a piece of layers
at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from site_engine.engine.core.api import EngineStats
from site_engine.finetune.jobs import FineTuneJobs
from site_engine.finetune.step_rows import StepRows
from site_engine.idle_work import IdleGate

# The jobs' piece bound as a share of max_training_delay_ms: a piece is sized from the last
# one's seconds per layer boundary, and a backward boundary costs about twice a forward one, so
# a piece sized to the whole bound on forward boundaries ran up to 1.6x over it (CPU preset).
PIECE_SHARE = 0.5


def serving_tokens(stats: EngineStats) -> int:
    """The tokens the next serving step may take: a decode row per running request and every
    prompt token not yet computed (an upper bound: the training rows get only what is surely
    left)."""
    return stats.num_running + stats.queued_prompt_tokens


@dataclass(frozen=True, slots=True)
class NextStep:
    """What the next serving step can take in: sequences, tokens, KV blocks.

    A request waiting for the next step's boundary only (a free sequence, its prompt within the
    step's token budget, its blocks free) is admitted by that step whatever runs before it, so a
    piece of training delays it by at most the bound, as it does a running request's next token.
    Rows mode used to run none while any request waited (FineInfer's rule): at 0.6x load on an
    H200 every arrival cost the job its piece, 28 % of the steps (issue 76's r88 runs). A request
    waiting for room (sequences, tokens or blocks) is a different matter: the running batch must
    drain for it, and training yields the card (no rows), as before."""

    token_budget: int
    max_num_seqs: int
    block_size: int

    def __post_init__(self) -> None:
        if min(self.token_budget, self.max_num_seqs, self.block_size) < 1:
            raise ValueError("NextStep needs a token budget, sequences and a block size >= 1")

    def admits_waiting(self, stats: EngineStats) -> bool:
        """Whether every waiting request (if any) fits the next step."""
        if stats.num_waiting == 0:
            return True
        free_tokens = (stats.kv_blocks_total - stats.kv_blocks_used) * self.block_size
        return (
            stats.num_running + stats.num_waiting <= self.max_num_seqs
            and serving_tokens(stats) <= self.token_budget
            # a block each may be part-used: a prompt can need one more than its tokens fill
            and stats.queued_prompt_tokens + stats.num_waiting * self.block_size <= free_tokens
        )


def rows_gate(max_training_delay_ms: float, next_step: NextStep) -> IdleGate:
    return IdleGate(
        max_unit_s=max_training_delay_ms / 1000,
        busy_share=1.0,
        admits_waiting=next_step.admits_waiting,
    )


class StepRowsWork:
    def __init__(
        self,
        jobs: FineTuneJobs,
        rows: StepRows,
        next_step: NextStep,
        stats: Callable[[], EngineStats],
    ) -> None:
        if jobs.settings.max_step_ms > rows.max_training_delay_ms:
            raise ValueError("the jobs' piece bound must be within max_training_delay_ms")
        self.jobs, self.rows, self.next_step = jobs, rows, next_step
        self._stats = stats
        self.delays_ms: list[float] = []  # each piece run beside serving (the bench reads them)

    def has_work(self) -> bool:
        return self.jobs.has_work()

    def next_unit_s(self) -> float:
        """The bound once the jobs measured a piece (rows are sized to it); else theirs."""
        predicted = self.jobs.next_unit_s()
        if math.isinf(predicted):
            return predicted
        return min(predicted, self.rows.max_training_delay_ms / 1000)

    def run_unit(self, alone: bool) -> float:
        """One piece: alone, as an idle unit (nothing to delay); beside serving, `rows` rows
        sized to the step's room and the bound, or none when a request waits for room
        (NextStep)."""
        if alone:
            return self.jobs.run_unit(alone=True)
        stats = self._stats()
        blocked = 0 if self.next_step.admits_waiting(stats) else stats.num_waiting
        rows = self.rows.for_step(serving_tokens(stats), self.next_step.token_budget, blocked)
        if rows == 0:
            return 0.0
        seconds = self.jobs.run_unit(rows=rows)
        # On CUDA the piece before this one, measured as this one began (and this one too when
        # it ended its unit): each delayed its own serving step.
        for piece_s in self.jobs.pieces_measured_s:
            self.rows.observe(rows, piece_s)
            self.delays_ms.append(1000 * piece_s)
        return seconds
