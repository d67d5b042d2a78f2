"""Calibration: the predictor's expected length mapped onto what the served model really says.

A predictor can rank prompts by answer length well and still be off in scale: one trained on
reference answers predicts SmolLM2's answers ~4x too short. Retraining fixes ranking slowly;
the scale is fixed in seconds by a monotone map fitted on served (prompt, length) samples:

- expected tokens: isotonic regression of the true length on the raw expected length (the
  conditional mean, which is what routing sums per site; monotone, so the ranking is kept);
- p90 tokens: quantile mapping: the raw expected lengths are cut into bins of equal count, each
  bin's 90th percentile of the true lengths is read, and the bins' values are joined into a
  non-decreasing piecewise-linear map (a p90 from the same ranking signal, at the served scale).

Both maps are stored in the artifact's manifest as knots and applied with linear interpolation
(flat beyond the ends): microseconds per batch, no model call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_SAMPLES = 30
# Knots kept per map: isotonic regression on n samples has up to n steps; 64 keep its shape.
MAX_KNOTS = 64
_P90_BIN_SAMPLES = 40  # samples per bin of the p90 map (fewer bins when there are few samples)
_P90_MAX_BINS = 20


class CalibrationError(ValueError):
    """Too few or unusable samples to fit a calibration."""


@dataclass(frozen=True, slots=True)
class PiecewiseLinear:
    x: tuple[float, ...]
    y: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.x) < 1 or len(self.x) != len(self.y):
            raise ValueError("a piecewise-linear map needs as many x as y knots (>= 1)")
        if any(b < a for a, b in zip(self.x, self.x[1:], strict=False)):
            raise ValueError("knots must be sorted by x")
        if any(b < a for a, b in zip(self.y, self.y[1:], strict=False)):
            raise ValueError("a calibration map must be non-decreasing")
        if not all(math.isfinite(v) for v in (*self.x, *self.y)):
            raise ValueError("knots must be finite")

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return np.interp(np.asarray(values, dtype=np.float64), self.x, self.y)

    def to_json(self) -> dict[str, list[float]]:
        return {"x": list(self.x), "y": list(self.y)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PiecewiseLinear:
        return cls(tuple(float(v) for v in data["x"]), tuple(float(v) for v in data["y"]))


@dataclass(frozen=True, slots=True)
class Calibration:
    expected: PiecewiseLinear
    p90: PiecewiseLinear
    samples: int  # how many served samples it was fitted on
    source: str = ""  # where they came from (e.g. "gateway samples of model X")

    def apply(self, raw_expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(expected tokens, p90 tokens) at the served scale; p90 >= expected."""
        expected = np.maximum(self.expected(raw_expected), 0.0)
        p90 = np.maximum(np.ceil(self.p90(raw_expected)), np.ceil(expected))
        return expected, p90.astype(np.int64)

    def to_json(self) -> dict[str, Any]:
        return {
            "expected": self.expected.to_json(),
            "p90": self.p90.to_json(),
            "samples": self.samples,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        return cls(
            PiecewiseLinear.from_json(data["expected"]),
            PiecewiseLinear.from_json(data["p90"]),
            int(data["samples"]),
            str(data.get("source", "")),
        )


def _thin(x: np.ndarray, y: np.ndarray, knots: int) -> PiecewiseLinear:
    if len(x) > knots:
        keep = np.unique(np.linspace(0, len(x) - 1, knots).round().astype(np.int64))
        x, y = x[keep], y[keep]
    return PiecewiseLinear(tuple(float(v) for v in x), tuple(float(v) for v in y))


def _expected_map(raw: np.ndarray, actual: np.ndarray) -> PiecewiseLinear:
    # Imported here: the gateway's runtime applies a calibration without scikit-learn.
    from sklearn.isotonic import IsotonicRegression

    iso = IsotonicRegression(increasing=True, out_of_bounds="clip").fit(raw, actual)
    return _thin(np.asarray(iso.X_thresholds_), np.asarray(iso.y_thresholds_), MAX_KNOTS)


def _p90_map(raw: np.ndarray, actual: np.ndarray) -> PiecewiseLinear:
    order = np.argsort(raw, kind="stable")
    bins = max(2, min(_P90_MAX_BINS, len(raw) // _P90_BIN_SAMPLES))
    x, y = [], []
    for chunk in np.array_split(order, bins):
        x.append(float(np.median(raw[chunk])))
        y.append(float(np.percentile(actual[chunk], 90)))
    xs = np.asarray(x)
    ys = np.maximum.accumulate(np.asarray(y))  # longer predicted answers never get a lower p90
    return _thin(xs, ys, MAX_KNOTS)


def fit_calibration(
    raw_expected: Sequence[float] | np.ndarray,
    actual_tokens: Sequence[int] | np.ndarray,
    source: str = "",
    min_samples: int = MIN_SAMPLES,
) -> Calibration:
    """Fits both maps on (raw expected length, true length) pairs of served samples."""
    raw = np.asarray(raw_expected, dtype=np.float64)
    actual = np.asarray(actual_tokens, dtype=np.float64)
    if raw.shape != actual.shape or raw.ndim != 1:
        raise CalibrationError("raw_expected and actual_tokens must be 1-D and of equal length")
    if len(raw) < min_samples:
        raise CalibrationError(f"{len(raw)} samples: at least {min_samples} are needed")
    if not (np.isfinite(raw).all() and np.isfinite(actual).all()) or (actual < 0).any():
        raise CalibrationError("lengths must be finite and >= 0")
    return Calibration(_expected_map(raw, actual), _p90_map(raw, actual), len(raw), source)
