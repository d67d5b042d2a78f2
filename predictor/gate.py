"""The activation gate: a candidate predictor is served only if it beats every simple rival.

Every candidate (a retrained version, a recalibrated one) is scored on served samples it never
trained on: the gate split, chosen by a hash of the prompt (`in_gate_split`) and used for
nothing else. Its rivals, scored on the same samples:
- `active`: the version serving now (absent when none is);
- `served_mean`: the mean length of the served samples the candidate trained on, a constant;
- `tfidf`: TF-IDF + ridge regression fitted on those same samples (predictor.tfidf_length).

The metric is the one routing uses: MAE of the expected tokens (MICO sums expected tokens per
site, so their error is what unbalances sites). The candidate is activated only if it beats every
rival clearly: on the same gate samples, the mean of the paired differences of absolute errors
must be below zero by more than 1.645 standard errors (a one-sided 95% paired test), so a lucky
draw of a few dozen samples does not activate noise. Rank correlation and p90 coverage are
reported beside it, not voted on.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from predictor.evaluate import spearman

METRIC = "mae_tokens"
GATE_FRACTION = 0.2
Z_ONE_SIDED_95 = 1.645


def in_gate_split(prompt: str, fraction: float = GATE_FRACTION) -> bool:
    """Whether a served sample is kept for gating (never for training or calibrating)."""
    digest = hashlib.sha256(b"gate\0" + prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass(frozen=True, slots=True)
class Predictions:
    """One method's (expected, p90) tokens on the gate samples."""

    expected: np.ndarray
    p90: np.ndarray


@dataclass(frozen=True, slots=True)
class Scores:
    mae_tokens: float
    spearman: float
    p90_coverage: float
    mean_predicted: float
    samples: int


def score(
    expected: Sequence[float] | np.ndarray,
    p90: Sequence[float] | np.ndarray,
    actual: Sequence[int] | np.ndarray,
) -> Scores:
    e = np.asarray(expected, dtype=np.float64)
    q = np.asarray(p90, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    if not (len(e) == len(q) == len(a)) or len(a) == 0:
        raise ValueError("expected, p90 and actual need one value per sample (>= 1)")
    return Scores(
        mae_tokens=float(np.abs(e - a).mean()),
        spearman=float(spearman(e, a)),
        p90_coverage=float((a <= q).mean()),
        mean_predicted=float(e.mean()),
        samples=len(a),
    )


@dataclass(frozen=True, slots=True)
class GateDecision:
    activate: bool
    candidate: Scores
    rivals: Mapping[str, Scores]
    reason: str
    metric: str = METRIC

    def to_json(self) -> dict[str, Any]:
        return {
            "activate": self.activate,
            "metric": self.metric,
            "reason": self.reason,
            "candidate": asdict(self.candidate),
            "rivals": {name: asdict(s) for name, s in self.rivals.items()},
        }


def clearly_better(candidate: np.ndarray, rival: np.ndarray, actual: np.ndarray) -> bool:
    """Paired one-sided test on absolute errors: the candidate's are lower beyond noise."""
    diff = np.abs(np.asarray(candidate, dtype=np.float64) - actual) - np.abs(rival - actual)
    if len(diff) < 2:
        return False
    margin = Z_ONE_SIDED_95 * float(diff.std(ddof=1)) / math.sqrt(len(diff))
    return float(diff.mean()) < -margin


def decide(
    candidate: Predictions,
    rivals: Mapping[str, Predictions],
    actual: Sequence[int] | np.ndarray,
) -> GateDecision:
    if not rivals:
        raise ValueError("a gate needs at least one rival (the served-mean constant)")
    truth = np.asarray(actual, dtype=np.float64)
    mine = score(candidate.expected, candidate.p90, actual)
    theirs = {name: score(p.expected, p.p90, actual) for name, p in rivals.items()}
    unbeaten = [
        f"{name} {theirs[name].mae_tokens:.1f}"
        for name, p in rivals.items()
        if not clearly_better(candidate.expected, p.expected, truth)
    ]
    if unbeaten:
        reason = (
            f"not activated: MAE {mine.mae_tokens:.1f} is not clearly below "
            f"{', '.join(unbeaten)} on {mine.samples} gate samples"
        )
        return GateDecision(False, mine, theirs, reason)
    best = min(theirs.items(), key=lambda item: item[1].mae_tokens)
    reason = (
        f"activated: MAE {mine.mae_tokens:.1f} clearly below every rival "
        f"(best: {best[0]} {best[1].mae_tokens:.1f}) on {mine.samples} gate samples"
    )
    return GateDecision(True, mine, theirs, reason)


def constant_rival(train_lengths: Sequence[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The served-mean constant's (expected, p90) for n samples."""
    lengths = np.asarray(train_lengths, dtype=np.float64)
    if lengths.size == 0:
        raise ValueError("the served-mean constant needs training samples")
    return np.full(n, lengths.mean()), np.full(n, np.percentile(lengths, 90))
