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
interactive request's time to first token, and it is not idle capacity. (Measured with
`python -m bench.engine.priority --preset cpu`: at a bound of 32 tokens the interactive TTFT p99
went from 1.67x to 1.33x that of the same load alone, TPOT p99 1.14x to 1.12x, the batch's share
of the idle capacity 1.04 to 1.03.) Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from site_engine.engine.sequence import Sequence


@dataclass(slots=True)
class StepBudget:
    """Tokens still free in the step being scheduled, in all and for background prefill."""

    tokens: int
    background: int

    @classmethod
    def for_step(cls, max_tokens: int, background_step_tokens: int) -> StepBudget:
        """A fresh step's budget; `background_step_tokens` 0 means no deferral bound."""
        return cls(max_tokens, background_step_tokens or max_tokens)

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
