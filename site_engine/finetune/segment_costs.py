"""What each kind of segment of a training unit costs, so that a piece ends before the segment
that would take it past its time bound (issue 76).

A unit runs in pieces cut at boundaries (site_engine/finetune/pieces.py): before each decoder
layer's forward and backward, between the loss's chunks, before the optimizer step. The
segments between two boundaries are not alike: on an H200 at 8 x ~350 tokens a layer's forward
took ~2 ms, its backward about twice that, a loss chunk over a 128k vocabulary more than a layer,
the unit's head (its batch staged, the embedding) and the optimizer step something else again.
A piece sized by a count of boundaries from the last piece's mean put several heavy ones in one
piece, and the host's clock cannot end it in time on a GPU, where it runs ahead of the device.
So each kind's cost is learned from the device's own time for each segment (CUDA events at the
boundaries, read once the piece has synchronised), per token of the unit for the kinds that
scale with it, per segment for those that do not, and the piece asks, at each boundary, whether
the next segment still fits.

No torch here: the bookkeeping is arithmetic, tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# stage: the unit's start to its embedding (the batch padded and copied); head: the embedding,
# the attention mask and the rotary tables, to the first layer; unwind: the decoder's backward
# begun (autograd's walk of the unit's graph on the host, the labelled rows' gradient scattered
# back), to the last layer's backward.
SegmentKind = Literal["stage", "head", "forward", "loss", "unwind", "backward", "optimizer"]
SEGMENT_KINDS: tuple[SegmentKind, ...] = get_args(SegmentKind)

# Loss chunks are sized to a time of their own (trainer.LossChunks), the optimizer step touches
# only the LoRA state, and the unwind is mostly the host's walk of a graph of fixed depth: none
# scales with the unit's tokens.
_PER_SEGMENT: frozenset[SegmentKind] = frozenset({"loss", "unwind", "optimizer"})


@dataclass(slots=True)
class SegmentCosts:
    """An exponentially weighted mean of each kind's seconds (a token, or a segment)."""

    smoothing: float = 0.3  # the newest segment's weight
    _rates: dict[SegmentKind, float] = field(default_factory=dict, init=False)
    _peak: dict[SegmentKind, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], not {self.smoothing}")

    def predict(self, kind: SegmentKind, tokens: int) -> float | None:
        """The seconds a segment of `kind` in a unit of `tokens` is expected to take; None
        before one was seen. The larger of the mean and the last one seen: a segment whose
        cost just jumped (a new shape) is not averaged away before the next piece is cut."""
        rate = self._rates.get(kind)
        if rate is None:
            return None
        rate = max(rate, self._peak[kind])
        return rate if kind in _PER_SEGMENT else rate * max(tokens, 1)

    def observe(self, kind: SegmentKind, tokens: int, seconds: float) -> None:
        if seconds < 0 or tokens < 0:
            raise ValueError(f"a {kind} segment of {tokens} tokens in {seconds} s")
        rate = seconds if kind in _PER_SEGMENT else seconds / max(tokens, 1)
        old = self._rates.get(kind)
        self._rates[kind] = rate if old is None else old + self.smoothing * (rate - old)
        self._peak[kind] = rate

    def known(self, kind: SegmentKind) -> bool:
        return kind in self._rates


@dataclass(slots=True)
class PieceBudget:
    """One piece's predicted time so far, against its bound: `fits` at each boundary says
    whether the piece may go on into the next segment."""

    costs: SegmentCosts
    bound_s: float
    predicted_s: float = 0.0

    def fits(self, finished: SegmentKind, upcoming: SegmentKind, tokens: int) -> bool:
        """`finished` just ended; may `upcoming` run in the same piece? No when either is
        unknown (nothing says what it costs) or their sum would pass the bound."""
        done = self.costs.predict(finished, tokens)
        ahead = self.costs.predict(upcoming, tokens)
        if done is None or ahead is None:
            return False
        self.predicted_s += done
        return self.predicted_s + ahead <= self.bound_s
