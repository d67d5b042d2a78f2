"""The order in which waiting sequences are admitted (and, reversed, released).

Priority classes come first (fedllm_contract/priority.py): every interactive sequence is ahead of
every flex one, every flex one ahead of every batch one; the policies below order each class.

Within a class, sequences that were already scheduled once (i.e. preempted) always come first
under every policy, which requeues a preempted sequence at the front of its class:
they hold generated tokens a client is streaming, and re-running them late would waste the work
already spent on them.

"spf" (shortest predicted first) ranks a sequence by its expected output length plus an aging
term, `spf_aging * arrival_index`, the length capped by `spf_max_overtakes` so that at most that
many later arrivals of its class are admitted ahead of it however long its prediction: the rule
of fedllm_contract/spf.py, which the gateway's queue shares. spf_aging = 0 is pure SPF (may
starve: the bound is made of the aging).

Static keys keep the queue incremental: a sequence's rank never changes while it waits.
"static" admits in arrival order; it differs from "fcfs" in when it admits, not in whom.

The scheduler does not sort its queue by `admission_order` each step: waiting_queue.py keeps it
in this order as sequences come and go (tests/unit/engine/test_waiting_queue.py checks the two
agree); this function is the order's definition and serves tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

from fedllm_contract import spf
from site_engine.engine.core.sequence import Sequence

PolicyName = Literal["fcfs", "spf", "static"]
POLICY_NAMES: frozenset[str] = frozenset(get_args(PolicyName))
# SchedulerConfig.spf_max_overtakes' default (fedllm_contract/spf.py).
DEFAULT_SPF_MAX_OVERTAKES = spf.DEFAULT_MAX_OVERTAKES


def spf_length_cap(spf_aging: float, max_overtakes: int | None) -> float:
    """The longest expected length a sequence ranks by (inf: no cap)."""
    return spf.length_cap(spf_aging, max_overtakes)


def spf_rank(seq: Sequence, spf_aging: float, length_cap: float) -> float:
    """A sequence's SPF rank (lower is admitted first), fixed while it waits."""
    return spf.rank(seq.expected_output_tokens, seq.arrival_index, spf_aging, length_cap)


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
