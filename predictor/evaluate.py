"""Scoring length predictions the way the design asks for, always next to the trivial baselines.

accuracy            named bucket == true bucket (argmax, or the artifact's BucketDecision)
within_one          |named bucket - true bucket| <= 1
majority_baseline   accuracy of always answering the most common *training* bucket
mae_tokens          mean |expected length - true length|, in the serving model's tokens
spearman            rank correlation of expected length and true length (a constant predictor,
                    such as the training mean, ranks nothing: 0.0 by definition here)
kendall_tau         Kendall's tau-b of the same pairs: the share of pairs put in the right order
                    minus the share put in the wrong one (ties adjusted), what vLLM-LTR reports
                    for a shortest-first scheduler's ranking (0.0 for a constant predictor)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from predictor.buckets import BucketScheme
from predictor.decision import BucketDecision
from predictor.distribution import BucketLengths, expected_tokens
from predictor.prepare import LabeledRecord

ProbabilityFn = Callable[[list[str]], np.ndarray]


@dataclass(frozen=True, slots=True)
class Scores:
    accuracy: float
    within_one: float
    majority_baseline: float
    mae_tokens: float
    spearman: float
    n: int

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing the mean of their positions (as scipy.stats.rankdata)."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    boundaries = np.flatnonzero(np.diff(sorted_values)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [len(values)]))
    ranks = np.empty(len(values), dtype=np.float64)
    for start, end in zip(starts, ends, strict=True):
        ranks[order[start:end]] = (start + end + 1) / 2
    return ranks


def spearman(predicted: np.ndarray, actual: np.ndarray) -> float:
    if len(predicted) < 2:
        return 0.0
    a = average_ranks(np.asarray(predicted, dtype=np.float64))
    b = average_ranks(np.asarray(actual, dtype=np.float64))
    a, b = a - a.mean(), b - b.mean()
    denominator = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / denominator) if denominator > 0 else 0.0


def kendall_tau(predicted: np.ndarray, actual: np.ndarray) -> float:
    """Kendall's tau-b (scipy's, O(n log n)); 0.0 when either side is constant."""
    # Imported here: the gateway imports this module's neighbours without scipy.
    from scipy.stats import kendalltau  # type: ignore[import-untyped]

    a = np.asarray(predicted, dtype=np.float64)
    b = np.asarray(actual, dtype=np.float64)
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return 0.0
    return float(kendalltau(a, b).statistic)


def length_scores(
    expected: np.ndarray, p90: np.ndarray, actual: Sequence[int] | np.ndarray
) -> dict[str, float | int]:
    """How well predicted lengths rank and size the true ones: Kendall's tau, Spearman, MAE
    of the expected length, the share of answers at or under the p90, the mean prediction."""
    truth = np.asarray(actual, dtype=np.float64)
    guess = np.asarray(expected, dtype=np.float64)
    if len(truth) == 0 or guess.shape != truth.shape or np.shape(p90) != truth.shape:
        raise ValueError("expected, p90 and actual need one (and at least one) value per prompt")
    return {
        "kendall_tau": kendall_tau(guess, truth),
        "spearman": spearman(guess, truth),
        "mae_tokens": float(np.abs(guess - truth).mean()),
        "p90_coverage": float((truth <= np.asarray(p90)).mean()),
        "mean_predicted": float(guess.mean()),
        "n": len(truth),
    }


def majority_bucket(scheme: BucketScheme, train_lengths: Sequence[int]) -> int:
    counts = np.bincount(scheme.buckets_of(train_lengths), minlength=scheme.n_buckets)
    return int(counts.argmax())


def score(
    scheme: BucketScheme,
    lengths: Sequence[int],
    predicted_buckets: np.ndarray,
    predicted_tokens: np.ndarray,
    majority: int,
) -> Scores:
    true = scheme.buckets_of(lengths)
    actual = np.asarray(lengths, dtype=np.float64)
    if len(true) == 0:
        raise ValueError("cannot score an empty test set")
    return Scores(
        accuracy=float((predicted_buckets == true).mean()),
        within_one=float((np.abs(predicted_buckets - true) <= 1).mean()),
        majority_baseline=float((true == majority).mean()),
        mae_tokens=float(np.abs(predicted_tokens - actual).mean()),
        spearman=spearman(predicted_tokens, actual),
        n=len(true),
    )


def score_probabilities(
    probabilities: np.ndarray,
    table: BucketLengths,
    scheme: BucketScheme,
    records: Sequence[LabeledRecord],
    majority: int,
    decision: BucketDecision | None = None,
) -> Scores:
    return score(
        scheme,
        [r.length for r in records],
        (decision or BucketDecision()).apply(probabilities),
        expected_tokens(probabilities, table),
        majority,
    )


def score_model(
    probability_fn: ProbabilityFn,
    table: BucketLengths,
    scheme: BucketScheme,
    records: Sequence[LabeledRecord],
    majority: int,
    decision: BucketDecision | None = None,
) -> Scores:
    probabilities = probability_fn([r.prompt for r in records])
    return score_probabilities(probabilities, table, scheme, records, majority, decision)


def score_mean(
    scheme: BucketScheme,
    train_lengths: Sequence[int],
    records: Sequence[LabeledRecord],
    majority: int,
) -> Scores:
    """The 'predict the training mean' line: every prompt gets the same length."""
    mean = float(np.mean(train_lengths))
    n = len(records)
    bucket = np.full(n, scheme.bucket_of(round(mean)), dtype=np.int64)
    return score(scheme, [r.length for r in records], bucket, np.full(n, mean), majority)
