"""Calibration maps: fitted on served samples, stored in the artifact, applied by the runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest

from predictor.artifact import ArtifactError, load_manifest
from predictor.calibrate import write_calibrated
from predictor.calibration import (
    Calibration,
    CalibrationError,
    PiecewiseLinear,
    fit_calibration,
)
from predictor.distribution import expected_tokens
from predictor.runtime import LengthPredictor


def skewed(n: int, scale: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw predictions that rank answers right but are `scale` times too short, plus noise."""
    rng = np.random.default_rng(seed)
    true = rng.integers(5, 800, n).astype(np.float64)
    raw = true / scale * rng.uniform(0.8, 1.25, n)
    return raw, true


@pytest.mark.parametrize("scale", [0.5, 1.0, 4.0])
def test_the_expected_map_puts_predictions_at_the_served_scale(scale: float) -> None:
    raw, true = skewed(2000, scale)
    calibration = fit_calibration(raw, true)
    expected, p90 = calibration.apply(raw)
    assert abs(expected.mean() - true.mean()) < 0.02 * true.mean()
    assert np.abs(expected - true).mean() < 0.5 * np.abs(raw - true).mean() or scale == 1.0
    assert 0.85 <= (true <= p90).mean() <= 0.97  # p90 covers ~90% of answers
    assert (p90 >= expected).all()


def test_maps_are_monotone_so_ranking_is_kept() -> None:
    raw, true = skewed(500, 3.0, seed=4)
    calibration = fit_calibration(raw, true)
    grid = np.linspace(0, raw.max() * 1.5, 400)
    expected, p90 = calibration.apply(grid)
    assert (np.diff(expected) >= 0).all()
    assert (np.diff(p90) >= 0).all()
    assert len(calibration.expected.x) <= 64


@pytest.mark.parametrize(
    ("raw", "true", "message"),
    [
        ([1.0] * 10, [2] * 10, "at least 30"),
        ([1.0] * 40, [2] * 39, "equal length"),
        ([float("nan")] * 40, [2] * 40, "finite"),
        ([1.0] * 40, [-2] * 40, ">= 0"),
    ],
)
def test_unusable_samples_are_refused(raw, true, message) -> None:
    with pytest.raises(CalibrationError, match=message):
        fit_calibration(raw, true)


@pytest.mark.parametrize(
    ("x", "y"),
    [((1.0, 0.5), (1.0, 2.0)), ((0.0, 1.0), (2.0, 1.0)), ((0.0,), (1.0, 2.0))],
)
def test_bad_knots_are_refused(x, y) -> None:
    with pytest.raises(ValueError, match=r"knots|non-decreasing"):
        PiecewiseLinear(x, y)


def test_a_calibrated_artifact_predicts_through_its_map(sklearn_artifact, tmp_path) -> None:
    base = LengthPredictor.load(sklearn_artifact)
    prompts = ["Write a long essay about the sea.", "Answer yes or no: rain.", "Spell bread."]
    raw = base.raw_expected(prompts * 20)
    calibration = fit_calibration(raw, (raw * 3).round().astype(int), "test")
    manifest = write_calibrated(sklearn_artifact, tmp_path / "cal", calibration)
    calibrated = LengthPredictor.load(tmp_path / "cal")
    assert calibrated.version == manifest.version != base.version
    assert calibrated.manifest.calibration == calibration
    got = calibrated.predict_batch(prompts)
    want_expected, want_p90 = calibration.apply(base.raw_expected(prompts))
    assert [p.expected_tokens for p in got] == pytest.approx(want_expected.tolist())
    assert [p.p90_tokens for p in got] == want_p90.tolist()
    assert [p.bucket for p in got] == [p.bucket for p in base.predict_batch(prompts)]
    probabilities = calibrated.probabilities(prompts)
    assert calibrated.raw_expected(prompts) == pytest.approx(
        expected_tokens(probabilities, calibrated.manifest.lengths)
    )


def test_a_corrupt_calibration_fails_the_load(sklearn_artifact, tmp_path) -> None:
    raw = np.linspace(1, 100, 40)
    write_calibrated(sklearn_artifact, tmp_path / "cal", fit_calibration(raw, raw * 2))
    manifest_path = tmp_path / "cal" / "manifest.json"
    data = json.loads(manifest_path.read_text())
    data["calibration"]["expected"]["y"] = list(reversed(data["calibration"]["expected"]["y"]))
    manifest_path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="non-decreasing"):
        load_manifest(tmp_path / "cal")


def test_calibration_json_round_trip() -> None:
    raw, true = skewed(300, 2.0)
    calibration = fit_calibration(raw, true, "served")
    assert Calibration.from_json(json.loads(json.dumps(calibration.to_json()))) == calibration
