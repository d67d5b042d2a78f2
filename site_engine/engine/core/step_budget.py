"""One step's token budget, shared by the priority classes in the order they are served, and the
deferral bound on background work (issue 52, after FineInfer's deferred continuous batching).

A step's duration grows with the tokens it computes, and a request that arrives while a step runs
waits for that step before it can join the batch: its queueing is at most one iteration. So the
scheduler bounds the background (flex and batch) prefill tokens of every step by
`background_step_tokens`: an interactive request that arrives at any moment waits at most one
step whose background part is that bounded, then joins at once (it is admitted first, and
preempts background sequences for KV blocks or a batch slot). The bound is in tokens, not
seconds, because the scheduler runs without a clock and a step's time per token is the
hardware's: SITE_DEFERRAL_BOUND_TOKENS / the site's prefill rate (fedllm_site_prefill_tokens_per_
second) is the bound in seconds. Decode tokens (one per running sequence) are not deferred: they
are what keeps background work moving, and the batch-slot limit already bounds them.

A step that prefills an interactive prompt takes no background prefill at all: that step is the
interactive request's time to first token, and it is not idle capacity. Nor does a step while an
interactive request waits for a batch slot or blocks. A step that runs interactive decodes gives
background prefill the bound times the square of the share of batch slots the interactive rows
leave free: the capacity interactive load leaves shrinks as that load grows, and a step's extra
time must shrink faster, since queueing amplifies every millisecond a busy engine's steps gain
(a queue's wait grows as load / (1 - load)). Profiled with `python -m bench.engine.priority
--preset cpu`: the interactive TTFT p99 came from bursts that filled every slot, after steps
each ~30% longer with a full bound of background prefill had let the interactive queue build up;
the interactive rows themselves never waited on a background chunk. A step with no interactive
row at all takes the whole bound: one background iteration, what an interactive request that
arrives during it waits for (FineInfer's deferral bound: a waiting request joins once its
queueing plus one background iteration would pass the bound; here it joins at the next step, so
the bound is that step's background part).

The time side (`background_step_slack` > 0, once the engine's StepCostModel has seen enough
steps, step_cost.py): while interactive rows run, all the background rows of a step together,
decodes included, may add at most `slack` times what the step's interactive part is predicted
to take. Tokens were the wrong unit on fast hardware: a 512-token bound is a few percent of a
CPU-sized model's step and most of an 8B model's decode step on an H100. A background decode
that does not fit waits (keeping its blocks) for a step with room; a prefill is cut to fit.
Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.step_cost import StepCost


@dataclass(slots=True)
class StepBudget:
    """Tokens still free in the step being scheduled, in all and for background prefill."""

    tokens: int
    background: int
    bound: int = 0  # the deferral bound; 0: none
    # The time side: the learned step cost (None: not learned yet, or no slack) and the slack.
    cost: StepCost | None = None
    slack: float = 0.0
    # KV positions the step's rows read (each row's length after the step), for the cost.
    context: int = 0
    # Seconds background rows may still add to this step; inf: no time bound this step.
    background_s: float = math.inf
    max_tokens: int = 0

    @classmethod
    def for_step(
        cls,
        max_tokens: int,
        background_step_tokens: int,
        cost: StepCost | None = None,
        slack: float = 0.0,
    ) -> StepBudget:
        """A fresh step's budget; `background_step_tokens` 0 means no deferral bound in tokens,
        `slack` 0 (or no cost learned yet) none in time."""
        return cls(
            max_tokens,
            background_step_tokens or max_tokens,
            background_step_tokens,
            cost if slack > 0 else None,
            slack,
            max_tokens=max_tokens,
        )

    @property
    def timed(self) -> bool:
        """Whether background rows are bounded in time in this step (only ever with a cost)."""
        return self.background_s != math.inf

    def _times(self, seq: Sequence) -> StepCost | None:
        """The cost that bounds `seq` in this step: a background row's while timed, else None."""
        return self.cost if self.timed and seq.priority.is_background else None

    @property
    def scheduled_tokens(self) -> int:
        return self.max_tokens - self.tokens

    def interactive_planned(self, rows: int, waiting: bool, max_num_seqs: int) -> None:
        """The interactive class is planned: `rows` of its sequences run in this step, and
        `waiting` whether another, ready, waits for a slot or blocks. Background prefill then
        gets the bound times the squared share of the slots the interactive rows leave free (the
        whole bound if none runs), none while one waits; an interactive prefill has already taken
        it to 0. With a learned cost, background rows together get `slack` times the predicted
        time of the interactive part planned so far."""
        if rows and self.cost is not None:
            self.background_s = self.slack * self.cost.seconds(self.scheduled_tokens, self.context)
        if not self.bound:
            return
        if waiting:
            self.background = 0
        elif rows:
            free = max(max_num_seqs - rows, 0)
            share = self.bound * free * free // (max_num_seqs * max_num_seqs)
            self.background = min(self.background, share)

    def allowance(self, seq: Sequence, wanted: int, computed: int | None = None) -> int:
        """How many of the `wanted` next tokens of `seq` fit in this step; `computed`: the
        positions in its cache before them (default: the sequence's count)."""
        allowed = min(wanted, self.tokens)
        if _deferred(seq, wanted):
            allowed = min(allowed, self.background)
        cost = self._times(seq)
        if cost is not None:
            before = seq.num_computed_tokens if computed is None else computed
            allowed = min(allowed, self._fits_in_time(cost, before))
        return allowed

    def _fits_in_time(self, cost: StepCost, computed: int) -> int:
        """The most new tokens of a background row with `computed` positions in its cache whose
        extra time fits what background work may still add to this step."""
        per_token = cost.per_token_s + cost.per_context_s
        room = self.background_s - cost.per_context_s * computed
        if room < per_token:
            return 0
        return self.tokens if per_token <= 0 else int(room / per_token)

    def take(self, seq: Sequence, wanted: int, num_tokens: int) -> None:
        """`num_tokens` of the `wanted` next tokens of `seq` are scheduled in this step (its
        chunk made: its computed count includes them)."""
        self.tokens -= num_tokens
        total = seq.num_computed_tokens
        self.context += total
        cost = self._times(seq)
        if cost is not None:
            self.background_s -= cost.extra_seconds(num_tokens, total)
        if _deferred(seq, wanted):
            self.background -= num_tokens
        elif not seq.priority.is_background and num_tokens > 1:
            self.background = 0  # an interactive prefill: this step is its first token's wait


def _deferred(seq: Sequence, wanted: int) -> bool:
    """Background prefill (or recompute) is what the deferral bound limits; a decode, one
    token, is not."""
    return seq.priority.is_background and wanted > 1
