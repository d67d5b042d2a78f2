"""The order in which waiting sequences are admitted (and, reversed, released).

Priority classes come first (fedllm_contract/priority.py): every interactive sequence is ahead of
every flex one, every flex one ahead of every batch one; the policies below order each class.

Within a class, sequences that were already scheduled once (i.e. preempted) always come first
under every policy, which requeues a preempted sequence at the front of its class:
they hold generated tokens a client is streaming, and re-running them late would waste the work
already spent on them.

"spf" (shortest predicted first) ranks a sequence by its expected output length plus an aging
term, `spf_aging * arrival_index`. Aging is counted in arrivals rather than in time because a
long request can only starve while new, shorter ones keep arriving: a sequence with expected
length L ranks ahead of every later arrival (expected length >= 1) once more than
(L - 1) / spf_aging requests have arrived after it. spf_aging = 0 is pure SPF (may starve).

`spf_max_overtakes` (K) makes that a hard bound whatever the prediction: the length a sequence
ranks by is capped at `spf_length_cap` = 0.75 + spf_aging * (K + 1) tokens, so that only the K
arrivals right after a sequence can ever rank ahead of it (a later one, of expected length >= 1,
ranks at >= 1 + spf_aging * (i + K + 1) > cap + spf_aging * i): at most K requests that arrived
after a sequence are admitted before it, however long its prediction (the 0.25 below the
boundary keeps float rounding from deciding it). Longer predictions than the cap rank among
themselves first come, first served. The bound is made of the aging: with spf_aging = 0 there is
no arrival term to bound by, and pure SPF keeps no bound. None: the aging alone.

Static keys keep the queue incremental: a sequence's rank never changes while it waits.
"static" admits in arrival order; it differs from "fcfs" in when it admits, not in whom.

The scheduler does not sort its queue by `admission_order` each step: waiting_queue.py keeps it
in this order as sequences come and go (tests/unit/engine/test_waiting_queue.py checks the two
agree); this function is the order's definition and serves tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

from site_engine.engine.core.sequence import Sequence

PolicyName = Literal["fcfs", "spf", "static"]
POLICY_NAMES: frozenset[str] = frozenset(get_args(PolicyName))
# The hard bound on later arrivals admitted ahead of a waiting sequence under SPF (the module
# docstring); SchedulerConfig.spf_max_overtakes' default.
DEFAULT_SPF_MAX_OVERTAKES = 256


def spf_length_cap(spf_aging: float, max_overtakes: int | None) -> float:
    """The longest expected length a sequence ranks by (inf: no cap)."""
    if max_overtakes is None or spf_aging <= 0:
        return float("inf")
    if max_overtakes < 0:
        raise ValueError(f"spf_max_overtakes must be >= 0 or None, got {max_overtakes}")
    return 0.75 + spf_aging * (max_overtakes + 1)


def spf_rank(seq: Sequence, spf_aging: float, length_cap: float) -> float:
    """A sequence's SPF rank (lower is admitted first), fixed while it waits."""
    return min(seq.expected_output_tokens, length_cap) + spf_aging * seq.arrival_index


def admission_order(
    waiting: Iterable[Sequence],
    policy: PolicyName,
    spf_aging: float,
    spf_max_overtakes: int | None = None,
) -> list[Sequence]:
    """`waiting` sorted from the first to be admitted to the last."""
    if policy == "spf":
        cap = spf_length_cap(spf_aging, spf_max_overtakes)

        def spf_key(seq: Sequence) -> tuple[int, bool, float, int]:
            rank = spf_rank(seq, spf_aging, cap)
            return (seq.priority, not seq.ever_scheduled, rank, seq.arrival_index)

        return sorted(waiting, key=spf_key)

    def fcfs_key(seq: Sequence) -> tuple[int, bool, int]:
        return (seq.priority, not seq.ever_scheduled, seq.arrival_index)

    return sorted(waiting, key=fcfs_key)
