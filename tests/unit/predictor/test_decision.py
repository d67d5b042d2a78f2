"""The named-bucket rule: argmax with one fitted log-bias, and its manifest round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from predictor.artifact import ArtifactError, load_manifest
from predictor.decision import BucketDecision, fit_decision
from predictor.runtime import LengthPredictor

PROBABILITIES = np.array(
    [
        [0.9, 0.1, 0.0],
        [0.6, 0.4, 0.0],
        [0.45, 0.55, 0.0],
        [0.2, 0.1, 0.7],
    ]
)


@pytest.mark.parametrize(
    ("decision", "named"),
    [
        (BucketDecision(0, 0.0), [0, 0, 1, 2]),  # plain argmax
        (BucketDecision(0, 1.0), [0, 0, 0, 2]),  # toward bucket 0: e^1 x 0.45 > 0.55
        (BucketDecision(0, -0.5), [0, 1, 1, 2]),  # away from it: e^-0.5 x 0.6 < 0.4
        (BucketDecision(0, -4.0), [1, 1, 1, 2]),
        (BucketDecision(1, 2.0), [0, 1, 1, 1]),  # the bias can sit on any bucket
    ],
)
def test_the_bias_moves_decisions_toward_or_away_from_its_bucket(decision, named):
    assert decision.apply(PROBABILITIES).tolist() == named


def _rows(probabilities: list[float], truths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([probabilities] * len(truths)), np.array(truths)


@pytest.mark.parametrize(
    ("probabilities", "truths", "expected_bias"),
    [
        # Calibrated already (bucket 0 is right 60% of the time at p0 = 0.6): no bias.
        ([0.6, 0.4], [0] * 6 + [1] * 4, 0.0),
        # p0 = 0.5 but bucket 0 is right 80% of the time: odds 4 -> log 4 = 1.39.
        ([0.5, 0.5], [0] * 8 + [1] * 2, 1.4),
        # Overconfident the other way: p0 = 0.8 but right 50% -> odds 1/4 -> -1.39.
        ([0.8, 0.2], [0] * 5 + [1] * 5, -1.4),
        # Always right on bucket 0: the likelihood keeps rising, so the grid's end.
        ([0.6, 0.4], [0] * 10, 3.0),
    ],
)
def test_fit_recalibrates_the_bucket_to_its_observed_odds(probabilities, truths, expected_bias):
    decision = fit_decision(*_rows(probabilities, truths), 0)
    assert decision == BucketDecision(0, expected_bias)


def test_a_fitted_bias_moves_argmax_where_the_odds_say():
    probabilities, truths = _rows([0.45, 0.55], [0] * 7 + [1] * 3)
    assert probabilities.argmax(axis=1).tolist() == [1] * 10
    decision = fit_decision(probabilities, truths, 0)
    assert decision.apply(probabilities).tolist() == [0] * 10


def test_fit_without_rows_is_plain_argmax():
    assert fit_decision(np.zeros((0, 3)), np.zeros(0), 2) == BucketDecision(2, 0.0)


def test_trained_artifacts_carry_a_fitted_rule_that_the_runtime_applies(minilm_artifact):
    predictor = LengthPredictor.load(minilm_artifact)
    decision = predictor.manifest.decision
    fitted = predictor.manifest.metrics["decision"]
    assert (fitted["bucket"], fitted["log_bias"]) == (decision.bucket, decision.log_bias)
    assert 0.0 <= fitted["validation_accuracy_decided"] <= 1.0
    prompts = ["Write a long essay about rain.", "Spell bread.", ""]
    named = decision.apply(predictor.probabilities(prompts))
    assert [p.bucket for p in predictor.predict_batch(prompts)] == named.tolist()


@pytest.fixture
def sklearn_copy(sklearn_artifact, tmp_path) -> Path:
    target = tmp_path / "artifact"
    shutil.copytree(sklearn_artifact, target)
    return target


def test_an_artifact_without_a_rule_reads_as_argmax(sklearn_copy):
    path = sklearn_copy
    manifest_file = path / "manifest.json"
    data = json.loads(manifest_file.read_text())
    data.pop("decision")
    manifest_file.write_text(json.dumps(data))
    assert load_manifest(path).decision == BucketDecision(0, 0.0)


@pytest.mark.parametrize(
    "decision", [{"bucket": 99, "log_bias": 0.0}, {"bucket": 0, "log_bias": "nan"}, {"bucket": 0}]
)
def test_a_bad_rule_is_an_artifact_error(sklearn_copy, decision):
    path = sklearn_copy
    manifest_file = path / "manifest.json"
    data = json.loads(manifest_file.read_text())
    data["decision"] = decision
    manifest_file.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=r"decision|log_bias"):
        load_manifest(path)
