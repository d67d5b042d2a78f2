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


def admission_order(
    waiting: Iterable[Sequence], policy: PolicyName, spf_aging: float
) -> list[Sequence]:
    """`waiting` sorted from the first to be admitted to the last."""
    if policy == "spf":

        def spf_key(seq: Sequence) -> tuple[int, bool, float, int]:
            rank = seq.expected_output_tokens + spf_aging * seq.arrival_index
            return (seq.priority, not seq.ever_scheduled, rank, seq.arrival_index)

        return sorted(waiting, key=spf_key)

    def fcfs_key(seq: Sequence) -> tuple[int, bool, int]:
        return (seq.priority, not seq.ever_scheduled, seq.arrival_index)

    return sorted(waiting, key=fcfs_key)
