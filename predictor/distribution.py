"""From bucket probabilities to lengths in tokens: the expected length and an upper quantile.

Each bucket carries two numbers from the training lengths that fell in it: their mean (the
bucket's representative, so the expected length is sum p_i * mean_i) and their 90th percentile.
The p90 of a prediction is read in the bucket where the cumulative probability first reaches 0.9,
as the p90 of the training lengths inside it: the last bucket's upper edge (l_max) is not a
bound on a length, so the edge alone would understate the longest answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from predictor.buckets import BucketScheme

P90 = 0.9
# Float sums of probabilities may land a hair under 0.9 where they should reach it.
_CUMULATIVE_SLACK = 1e-6


@dataclass(frozen=True, slots=True)
class BucketLengths:
    representatives: tuple[float, ...]
    p90: tuple[int, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.representatives)
        if n < 2 or len(self.p90) != n or len(self.counts) != n:
            raise ValueError("representatives, p90 and counts need one value per bucket (>= 2)")
        if any(not math.isfinite(r) or r < 0 for r in self.representatives):
            raise ValueError(f"representative lengths must be finite and >= 0: {self}")


def bucket_lengths(scheme: BucketScheme, lengths: Sequence[int]) -> BucketLengths:
    """Mean and p90 of the training lengths in each bucket (bucket bounds where it is empty)."""
    values = np.asarray(lengths, dtype=np.float64)
    labels = scheme.buckets_of(lengths) if len(lengths) else np.zeros(0, dtype=np.int64)
    reps: list[float] = []
    p90s: list[int] = []
    counts: list[int] = []
    for bucket in range(scheme.n_buckets):
        members = values[labels == bucket]
        low, high = scheme.edges[bucket], scheme.edges[bucket + 1]
        if members.size:
            reps.append(float(members.mean()))
            p90s.append(math.ceil(float(np.percentile(members, 90))))
        else:
            reps.append((low + high) / 2)
            p90s.append(math.ceil(high))
        counts.append(int(members.size))
    return BucketLengths(tuple(reps), tuple(p90s), tuple(counts))


def expected_tokens(probabilities: np.ndarray, table: BucketLengths) -> np.ndarray:
    """Sum p_i * representative_i per row (a 1-D input gives a 0-D array)."""
    probs = np.asarray(probabilities, dtype=np.float64)
    return np.asarray(probs @ np.asarray(table.representatives), dtype=np.float64)


def p90_tokens(probabilities: np.ndarray, table: BucketLengths) -> np.ndarray:
    """The p90 length of the bucket where each row's cumulative probability reaches 0.9."""
    cumulative = np.cumsum(np.asarray(probabilities, dtype=np.float64), axis=-1)
    reached = cumulative >= P90 - _CUMULATIVE_SLACK
    # A row that never reaches 0.9 (probabilities not normalised) uses the last bucket.
    index = np.where(reached.any(axis=-1), reached.argmax(axis=-1), cumulative.shape[-1] - 1)
    return np.asarray(np.asarray(table.p90, dtype=np.int64)[index], dtype=np.int64)
