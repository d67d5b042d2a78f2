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
the bound is that step's background part). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from site_engine.engine.core.sequence import Sequence


@dataclass(slots=True)
class StepBudget:
    """Tokens still free in the step being scheduled, in all and for background prefill."""

    tokens: int
    background: int
    bound: int = 0  # the deferral bound; 0: none

    @classmethod
    def for_step(cls, max_tokens: int, background_step_tokens: int) -> StepBudget:
        """A fresh step's budget; `background_step_tokens` 0 means no deferral bound."""
        return cls(max_tokens, background_step_tokens or max_tokens, background_step_tokens)

    def interactive_planned(self, rows: int, waiting: bool, max_num_seqs: int) -> None:
        """The interactive class is planned: `rows` of its sequences run in this step, and
        `waiting` whether another, ready, waits for a slot or blocks. Background prefill then
        gets the bound times the squared share of the slots the interactive rows leave free (the
        whole bound if none runs), none while one waits; an interactive prefill has already taken
        it to 0."""
        if not self.bound:
            return
        if waiting:
            self.background = 0
        elif rows:
            free = max(max_num_seqs - rows, 0)
            share = self.bound * free * free // (max_num_seqs * max_num_seqs)
            self.background = min(self.background, share)

    def allowance(self, seq: Sequence, wanted: int) -> int:
        """How many of the `wanted` next tokens of `seq` fit in this step."""
        allowed = min(wanted, self.tokens)
        return min(allowed, self.background) if _deferred(seq, wanted) else allowed

    def take(self, seq: Sequence, wanted: int, num_tokens: int) -> None:
        """`num_tokens` of the `wanted` next tokens of `seq` are scheduled in this step."""
        self.tokens -= num_tokens
        if _deferred(seq, wanted):
            self.background -= num_tokens
        elif not seq.priority.is_background and num_tokens > 1:
            self.background = 0  # an interactive prefill: this step is its first token's wait


def _deferred(seq: Sequence, wanted: int) -> bool:
    """Background prefill (or recompute) is what the deferral bound limits; a decode, one
    token, is not."""
    return seq.priority.is_background and wanted > 1
