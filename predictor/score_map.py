"""A ranking head's score read as lengths: the map a ranking artifact's manifest carries.

A model trained to rank (predictor.ranking) outputs one number per prompt whose order is the
order of the answers' lengths, not a length. Routing and the sites' queues plan in tokens, so
the artifact also carries a monotone map from score to tokens, fitted on training-split prompts
the ranking head learned from (never on validation):

- expected tokens: isotonic regression of the true length on the score (the conditional mean),
  plus a ramp of RAMP_TOKENS over the knots so that it is strictly increasing: isotonic
  regression is flat over each pooled block, which would give prompts the score tells apart
  the same expected length (a tie for shortest-first ordering);
- p90 tokens: the 90th percentile of the true lengths in bins of equal count along the score,
  made non-decreasing (predictor.calibration's quantile map).

Both are piecewise-linear knots (predictor.calibration.PiecewiseLinear) applied with
`np.interp`: no scikit-learn at the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from predictor.calibration import Calibration, PiecewiseLinear, fit_calibration

# The graph output holding the score (higher: a longer answer).
RANK_OUTPUT = "rank_score"
# What the ramp adds to the expected length from the lowest knot to the highest, in tokens:
# below the gateway's rounding, so calibration is unchanged, but the order is kept.
RAMP_TOKENS = 1.0


@dataclass(frozen=True, slots=True)
class RankingHead:
    """The manifest's `ranking` block: which graph output is the score and how it maps to
    tokens. An artifact without it is a plain classifier (lengths from its probabilities)."""

    lengths: Calibration
    output: str = RANK_OUTPUT
    loss: str = ""  # the loss the head was trained with (listmle, pairwise), for the record

    def apply(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(expected tokens, p90 tokens) of each score."""
        return self.lengths.apply(np.asarray(scores, dtype=np.float64))

    def to_json(self) -> dict[str, Any]:
        return {"output": self.output, "loss": self.loss, "lengths": self.lengths.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankingHead:
        output = data["output"]
        if not isinstance(output, str) or not output:
            raise ValueError(f"ranking.output must be a graph output name, got {output!r}")
        return cls(Calibration.from_json(data["lengths"]), output, str(data.get("loss", "")))


def _ramped(curve: PiecewiseLinear, ramp: float) -> PiecewiseLinear:
    """The same knots plus a linear ramp of `ramp` tokens from the first to the last: strictly
    increasing wherever the knots' x differ."""
    x = np.asarray(curve.x, dtype=np.float64)
    y = np.asarray(curve.y, dtype=np.float64)
    if len(x) < 2 or x[-1] <= x[0]:
        return curve
    y = y + ramp * (x - x[0]) / (x[-1] - x[0])
    return PiecewiseLinear(tuple(float(v) for v in x), tuple(float(v) for v in y))


def fit_score_map(
    scores: Sequence[float] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    source: str = "",
    ramp: float = RAMP_TOKENS,
) -> Calibration:
    """The score -> (expected, p90) map on (score, true length) pairs (CalibrationError when
    there are too few or they are not finite)."""
    fitted = fit_calibration(scores, lengths, source)
    return replace(fitted, expected=_ramped(fitted.expected, ramp))
