"""The predictor's rolling error on served traffic, and the rule that calls it drifted.

A window is one model's last finished requests predicted by one version: (predicted expected
tokens, true completion tokens) pairs. Its error is measured the way the activation gate
(predictor/gate.py) measures a candidate: the MAE of expected tokens, the rank correlation
(Spearman) and, as the yardstick, the MAE of the constant that predicts the window's mean served
length. The baseline is fitted on the window itself, so it is a little optimistic; that only
makes the rule quicker to call drift. Pure functions: the store reads the pairs (SQL), the
service caches the results (gateway/admin/predictor_health.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RollingError:
    samples: int
    mae_tokens: float
    # The MAE of predicting the window's mean true length for every request.
    served_mean_mae_tokens: float
    # mae_tokens / served_mean_mae_tokens; inf when every answer had the same length.
    mae_ratio: float
    # Rank correlation of predicted and true lengths; 0 when either side is constant.
    spearman: float
    mean_predicted_tokens: float
    mean_served_tokens: float


@dataclass(frozen=True, slots=True)
class DriftRule:
    """Drifted when the window holds at least `min_samples` and the predictor is no better than
    the served-mean constant (mae_ratio >= max_mae_ratio) or ranks too poorly (spearman below
    min_spearman). The window (hundreds of requests) is what smooths the signal."""

    min_samples: int
    max_mae_ratio: float
    min_spearman: float

    def verdict(self, error: RollingError | None) -> tuple[bool, str]:
        """(drifted, why), the reason in words for the dashboard and the job record."""
        if error is None or error.samples < self.min_samples:
            seen = 0 if error is None else error.samples
            return False, f"{seen} samples < {self.min_samples}: not judged"
        reasons = []
        if error.mae_ratio >= self.max_mae_ratio:
            reasons.append(f"MAE {error.mae_ratio:.2f}x the served mean's >= {self.max_mae_ratio}")
        if error.spearman < self.min_spearman:
            reasons.append(f"Spearman {error.spearman:.3f} < {self.min_spearman}")
        if reasons:
            return True, "; ".join(reasons)
        return False, f"MAE {error.mae_ratio:.2f}x the served mean's, Spearman {error.spearman:.3f}"


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank (as scipy.stats.rankdata's default)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        mean_rank = (start + end) / 2 + 1
        for k in range(start, end + 1):
            result[order[k]] = mean_rank
        start = end + 1
    return result


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson correlation of the ranks; 0 when either side has no spread."""
    if len(xs) != len(ys):
        raise ValueError("spearman needs two sequences of one length")
    if len(xs) < 2:
        return 0.0
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        return 0.0
    return cov / math.sqrt(vx * vy)


def rolling_error(pairs: Sequence[tuple[int, int]]) -> RollingError | None:
    """The error of (predicted, true) token pairs; None for an empty window."""
    if not pairs:
        return None
    predicted = [float(p) for p, _ in pairs]
    served = [float(t) for _, t in pairs]
    n = len(pairs)
    mean_served = sum(served) / n
    mae = sum(abs(p - t) for p, t in zip(predicted, served, strict=True)) / n
    baseline = sum(abs(mean_served - t) for t in served) / n
    # Every answer the same length: any error at all is worse than the constant.
    ratio = mae / baseline if baseline > 0 else (math.inf if mae > 0 else 1.0)
    return RollingError(
        samples=n,
        mae_tokens=mae,
        served_mean_mae_tokens=baseline,
        mae_ratio=ratio,
        spearman=spearman(predicted, served),
        mean_predicted_tokens=sum(predicted) / n,
        mean_served_tokens=mean_served,
    )
