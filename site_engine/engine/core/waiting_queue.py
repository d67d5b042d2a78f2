"""The waiting sequences, kept in admission order class by class as they come and go, so that a
step never sorts or regroups the whole queue (issue 50: with 10,000 waiting, sorting them every
step cost more host time than the step's decode). Pure Python.

The order is scheduling_policy.admission_order's, exactly: a sequence's place within its class
is given by a key that does not change while it waits (whether it was ever scheduled, its
arrival index, and under SPF its rank: expected output length, capped by the overtaking bound,
plus aging; fixed at `add`), so each class is a
list sorted by that key, kept sorted by binary insertion (a preempted sequence's key sorts it
ahead of every fresh one, as admission_order puts it). Keys are unique (the arrival index is),
so the sorted list is the one order sorting would give. Inserting and removing one sequence costs
a bisection and a move of the list's pointers (memmove); appending a fresh FCFS arrival lands at
the end.

It also keeps two sums stats() reports, per class, so that they cost no walk over the queue: the
tokens waiting and the output tokens they are expected to produce. Neither changes while a sequence
waits (a preempted one's pending token, resolved while it waits, moves from pending to known).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from fedllm_contract.priority import Priority
from site_engine.engine.core.scheduling_policy import (
    DEFAULT_SPF_MAX_OVERTAKES,
    PolicyName,
    spf_length_cap,
    spf_rank,
)
from site_engine.engine.core.sequence import Sequence, SequenceStatus

# (not ever scheduled, [SPF rank,] arrival index): admission_order's key without the class.
_Key = tuple[bool, float, int] | tuple[bool, int]


class WaitingQueue:
    """The waiting sequences of every class, each class in admission order."""

    def __init__(
        self,
        policy: PolicyName,
        spf_aging: float,
        spf_max_overtakes: int | None = DEFAULT_SPF_MAX_OVERTAKES,
    ) -> None:
        """`spf_max_overtakes`: SchedulerConfig's (scheduling_policy.py: the bound on later
        arrivals admitted ahead of a waiting sequence under SPF; None: the aging alone)."""
        self._spf = policy == "spf"
        self._aging = spf_aging
        self._cap = spf_length_cap(spf_aging, spf_max_overtakes)
        self._keys: dict[Priority, list[_Key]] = {priority: [] for priority in Priority}
        self._seqs: dict[Priority, list[Sequence]] = {priority: [] for priority in Priority}
        self._size = 0
        # Per class (the load report's per-class entries): sums of num_tokens and of
        # remaining_predicted_tokens.
        self._tokens = dict.fromkeys(Priority, 0)
        self._remaining = dict.fromkeys(Priority, 0)

    @property
    def tokens(self) -> int:
        """Tokens waiting, every class."""
        return sum(self._tokens.values())

    @property
    def remaining(self) -> int:
        """Output tokens the waiting sequences are expected to produce, every class."""
        return sum(self._remaining.values())

    def tokens_of(self, priority: Priority) -> int:
        return self._tokens[priority]

    def remaining_of(self, priority: Priority) -> int:
        return self._remaining[priority]

    def _count(self, seq: Sequence, sign: int) -> None:
        self._tokens[seq.priority] += sign * seq.num_tokens
        self._remaining[seq.priority] += sign * seq.remaining_predicted_tokens

    def _key(self, seq: Sequence) -> _Key:
        if self._spf:
            rank = spf_rank(seq, self._aging, self._cap)
            return (not seq.ever_scheduled, rank, seq.arrival_index)
        return (not seq.ever_scheduled, seq.arrival_index)

    def add(self, seq: Sequence) -> None:
        """Queue `seq` at its place in its class (a fresh arrival or a preempted one)."""
        key = self._key(seq)
        keys, seqs = self._keys[seq.priority], self._seqs[seq.priority]
        if not keys or keys[-1] < key:
            keys.append(key)  # the common case: a fresh arrival, the newest of its class
            seqs.append(seq)
        else:
            at = bisect_left(keys, key)
            keys.insert(at, key)
            seqs.insert(at, seq)
        self._count(seq, 1)
        self._size += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queue; ValueError if it is not in it."""
        key = self._key(seq)
        keys, seqs = self._keys[seq.priority], self._seqs[seq.priority]
        at = bisect_left(keys, key)
        if at == len(keys) or seqs[at] is not seq:
            raise ValueError(f"request {seq.request_id!r} is not waiting")
        del keys[at]
        del seqs[at]
        self._count(seq, -1)
        self._size -= 1

    def of_class(self, priority: Priority) -> list[Sequence]:
        """The waiting sequences of `priority` in admission order: the queue's own list, to be
        read, not changed (drop_admitted takes out those admitted from it)."""
        return self._seqs[priority]

    def admitting(self, seq: Sequence) -> None:
        """`seq` (of `of_class`) is being admitted: out of the sums now, before its first chunk
        changes its counts; out of the lists at `drop_admitted`, once the walk is over."""
        self._count(seq, -1)

    def drop_admitted(self, priority: Priority, count: int) -> None:
        """Take out the `count` sequences of `priority` no longer WAITING, each of them passed
        to `admitting` first."""
        if count == 0:
            return
        keys, seqs = self._keys[priority], self._seqs[priority]
        if all(seq.status is not SequenceStatus.WAITING for seq in seqs[:count]):
            del keys[:count], seqs[:count]  # the usual case: the head of the class was admitted
        else:
            kept = [i for i, seq in enumerate(seqs) if seq.status is SequenceStatus.WAITING]
            keys[:] = [keys[i] for i in kept]
            seqs[:] = [seqs[i] for i in kept]
        self._size -= count

    def count(self, priority: Priority) -> int:
        return len(self._seqs[priority])

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence in admission order (the classes from the top)."""
        for priority in Priority:
            yield from self._seqs[priority]

    def check(self) -> None:
        """Raise AssertionError if a class is out of order or its keys disagree (tests)."""
        total = 0
        for priority in Priority:
            keys, seqs = self._keys[priority], self._seqs[priority]
            if keys != sorted(keys) or keys != [self._key(seq) for seq in seqs]:
                raise AssertionError(f"waiting queue of {priority.name} out of order")
            if any(seq.priority is not priority for seq in seqs):
                raise AssertionError(f"waiting queue of {priority.name} holds another class")
            tokens = sum(s.num_tokens for s in seqs)
            sums = (tokens, sum(s.remaining_predicted_tokens for s in seqs))
            if (self._tokens[priority], self._remaining[priority]) != sums:
                raise AssertionError(f"waiting queue's token sums of {priority.name} out of step")
            total += len(seqs)
        if total != self._size:
            raise AssertionError(f"waiting queue size {self._size} != {total}")
