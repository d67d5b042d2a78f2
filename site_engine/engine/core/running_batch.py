"""The running sequences' step state as arrays, one row per sequence (issue 66).

A step of 1,024 running sequences used to cost ~30 Python calls per sequence on the host: the
scheduler walked every running sequence to give it its decode token, the runner walked every
chunk to build its inputs, the update walked every sampled token. Here a running sequence owns a
row of a few numpy arrays (its computed positions, its tokens, those still on the device, its
blocks, its class, its limits), so a step's common case, "every decoding sequence one more
token", is a handful of vectorized operations over the rows, and Python runs only for what
changed: admissions, finishes, preemptions, a new block, a prefill chunk, a constrained row.

The arrays are the truth for a sequence while it runs: `Sequence.num_computed_tokens` and its
siblings read its row (sequence.py); `detach` writes the row back into the sequence when it
stops running (finished, preempted), and the row is free for the next admission. A row's
`serial` names its occupant: a step that planned a row remembers the serial it saw, so a row
reused by the time that step's tokens come back (async scheduling) is never mistaken for it.

Numpy, no torch: the core stays the model-free part the simulator runs and the unit tests drive.
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from site_engine.engine.core.sequence import Sequence

T = TypeVar("T")
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class RunningBatch:
    """Rows of the running sequences' numeric state, and which sequence holds which row."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a running batch needs at least one row, not {capacity}")
        self.capacity = capacity
        zeros = np.zeros(capacity, dtype=np.int64)
        # Positions whose KV is in the cache or written by a scheduled step.
        self.computed = zeros.copy()
        # Prompt + answer tokens, those still on the device (`pending`) included.
        self.tokens = zeros.copy()
        self.pending = zeros.copy()
        # `tokens` at which the answer is complete: min(prompt + max_tokens, max_model_len).
        self.limit = zeros.copy()
        self.prompt_len = zeros.copy()
        self.max_tokens = zeros.copy()
        # Prompt + the answer length the admission plan expects (core/sequence.py).
        self.expected_total = zeros.copy()
        # Blocks in its table, and how many of them the model runner was told of.
        self.held = zeros.copy()
        self.synced = zeros.copy()
        # Computed positions from which its next block may be full (prefix caching).
        self.next_full = zeros.copy()
        # When it was admitted (a counter): the admission order, newest preempted first.
        self.order = zeros.copy()
        self.serial = np.full(capacity, -1, dtype=np.int64)
        self.prio = np.zeros(capacity, dtype=np.int64)
        self.active = np.zeros(capacity, dtype=np.bool_)
        self.ignore_eos = np.zeros(capacity, dtype=np.bool_)
        # Rows whose update needs Python: a grammar to advance.
        self.guided = np.zeros(capacity, dtype=np.bool_)
        # Whether the row sampled a token since it was taken: its last token is then the one
        # the model runner keeps on the device for the row, and one uncomputed token is a
        # decode (else, after a chunked recompute say, it is a prefill chunk of known tokens).
        self.fed = np.zeros(capacity, dtype=np.bool_)
        self.seqs: list[Sequence | None] = [None] * capacity
        # Each row's request id and answer list (the sequence's own): a step reads them for
        # its rows with one C-level gather (`pick`), not a Python loop over the sequences.
        self.ids: list[str] = [""] * capacity
        self.outs: list[list[int]] = [[] for _ in range(capacity)]
        # Lowest rows first: a batch of n running sequences stays in rows 0..n-1 mostly.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._next_serial = 0
        self._next_order = 0
        self.size = 0

    def attach(self, seq: Sequence, max_model_len: int) -> int:
        """Gives `seq` (just admitted) a row, its state copied in; the row."""
        if not self._free:
            raise RuntimeError("every row of the running batch is taken")
        row = self._free.pop()
        prompt = len(seq.prompt_token_ids)
        max_tokens = seq.sampling.max_tokens
        self.computed[row] = seq._computed
        self.pending[row] = seq._pending
        self.tokens[row] = prompt + len(seq.output_token_ids) + seq._pending
        self.limit[row] = min(prompt + max_tokens, max_model_len)
        self.prompt_len[row] = prompt
        self.max_tokens[row] = max_tokens
        self.expected_total[row] = seq.expected_total_tokens
        self.held[row] = 0
        self.synced[row] = 0
        self.next_full[row] = seq._next_full
        self.order[row] = self._next_order
        self._next_order += 1
        self.serial[row] = self._next_serial
        self._next_serial += 1
        self.prio[row] = int(seq.priority)
        self.active[row] = True
        self.ignore_eos[row] = seq.sampling.ignore_eos
        self.guided[row] = seq.guide is not None
        self.fed[row] = False
        self.seqs[row] = seq
        self.ids[row] = seq.request_id
        self.outs[row] = seq.output_token_ids
        seq._batch, seq._row = self, row
        self.size += 1
        return row

    def detach(self, seq: Sequence) -> None:
        """`seq` stops running: its row's state goes back into it and the row is free."""
        row = seq._row
        seq._computed = int(self.computed[row])
        seq._pending = int(self.pending[row])
        seq._next_full = int(self.next_full[row])
        seq._batch, seq._row = None, -1
        self.active[row] = False
        self.serial[row] = -1
        self.guided[row] = False
        self.seqs[row] = None
        self._free.append(row)
        self.size -= 1

    @staticmethod
    def pick(values: list[T], rows: IntArray) -> list[T]:
        """values[row] for each of `rows`, gathered in C (operator.itemgetter)."""
        count = rows.shape[0]
        if count == 0:
            return []
        if count == 1:
            return [values[int(rows[0])]]
        return list(itemgetter(*rows.tolist())(values))

    def rows(self) -> IntArray:
        """Every running row, lowest first."""
        return np.flatnonzero(self.active)

    def rows_of(self, priority: int) -> IntArray:
        """The running rows of one class, lowest first."""
        return np.flatnonzero(self.active & (self.prio == priority))

    def by_order(self, rows: IntArray) -> IntArray:
        """`rows` in admission order (oldest first)."""
        if rows.size < 2:
            return rows
        return rows[np.argsort(self.order[rows], kind="stable")]

    def check(self) -> None:
        """Raise AssertionError if the rows disagree with their sequences (tests)."""
        taken = np.flatnonzero(self.active)
        if taken.size != self.size or len(self._free) != self.capacity - self.size:
            raise AssertionError("running batch: row counts out of step")
        for row in taken.tolist():
            seq = self.seqs[row]
            if seq is None or seq._row != row or seq._batch is not self:
                raise AssertionError(f"running batch: row {row} and its sequence disagree")
            known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
            if int(self.tokens[row]) != known + int(self.pending[row]):
                raise AssertionError(f"running batch: row {row} counts {self.tokens[row]} tokens")
        for row in self._free:
            if self.active[row] or self.seqs[row] is not None:
                raise AssertionError(f"running batch: free row {row} is taken")
