"""Adapting a predictor to served samples: calibrate and retrain modes, the gate's verdict, and
bad input refused before anything is written."""

from __future__ import annotations

import random

import pytest

from predictor.artifact import WEIGHTS_FILE, load_manifest
from predictor.gate import in_gate_split
from predictor.retrain import RetrainReport, retrain
from predictor.runtime import LengthPredictor
from predictor.training import TrainSpec
from tests.unit.predictor.conftest import TINY_FINETUNE, synthetic_records


def _samples(n: int, seed: int, scale: int = 3) -> list[tuple[str, int]]:
    # Scaled lengths: the served model answers longer than the corpora did.
    records = synthetic_records(n, seed)
    return [(r.prompt + f" #{i}", r.length * scale) for i, r in enumerate(records)]


def quiet(_: str) -> None:
    pass


def test_calibrate_fixes_the_scale_and_is_activated(sklearn_artifact, tmp_path):
    samples = _samples(200, seed=7)
    report = retrain(samples, sklearn_artifact, tmp_path / "cal", mode="calibrate", progress=quiet)
    assert isinstance(report, RetrainReport)
    assert report.samples == 200
    assert report.gate_samples == sum(in_gate_split(p) for p, _ in samples)
    assert report.train_samples + report.gate_samples == 200
    new = LengthPredictor.load(tmp_path / "cal")
    base = load_manifest(sklearn_artifact)
    assert new.manifest.calibration is not None
    assert new.manifest.calibration.samples == report.train_samples
    assert new.manifest.scheme == base.scheme  # same edges: buckets mean the same
    assert report.new_version == new.version != base.version
    assert new.manifest.training["parent_version"] == base.version
    active = report.current
    assert active is not None
    assert report.new.mae_tokens < 0.6 * active.mae_tokens  # the base is 3x too short
    assert report.better, report.reason
    assert set(report.decision.rivals) == {"active", "served_mean", "tfidf"}


def test_the_gate_refuses_a_useless_candidate(sklearn_artifact, tmp_path):
    """Lengths that the prompts say nothing about: whatever the candidate learned is noise, and
    the served mean is at least as good, so it is not activated."""
    rng = random.Random(3)
    samples = [(p, rng.randint(1, 900)) for p, _ in _samples(240, seed=11)]
    report = retrain(samples, sklearn_artifact, tmp_path / "noise", mode="calibrate",
                     progress=quiet)  # fmt: skip
    assert not report.better
    assert report.reason.startswith("not activated")
    assert "served_mean" in report.reason


def test_retrain_warm_starts_from_the_base_weights(minilm_artifact, tmp_path):
    assert (minilm_artifact / WEIGHTS_FILE).is_file()
    spec = TrainSpec("minilm", finetune=TINY_FINETUNE)
    report = retrain(_samples(120, seed=3), minilm_artifact, tmp_path / "v2", spec=spec,
                     progress=quiet)  # fmt: skip
    new = LengthPredictor.load(tmp_path / "v2")
    assert new.manifest.kind == "minilm"
    assert new.manifest.scheme == load_manifest(minilm_artifact).scheme
    assert new.manifest.training["warm_start"].endswith(WEIGHTS_FILE)
    assert new.manifest.calibration is not None
    assert (tmp_path / "v2" / WEIGHTS_FILE).is_file()  # the next retrain can warm-start from it
    assert report.mode == "retrain"


def test_retrain_without_warm_start_trains_from_the_pretrained_encoder(minilm_artifact, tmp_path):
    spec = TrainSpec("minilm", finetune=TINY_FINETUNE)
    retrain(_samples(120, seed=3), minilm_artifact, tmp_path / "cold", spec=spec,
            warm_start=False, progress=quiet)  # fmt: skip
    assert "warm_start" not in LengthPredictor.load(tmp_path / "cold").manifest.training


@pytest.mark.parametrize(
    ("samples", "error"),
    [
        ([("ok", -1)], ValueError),
        ([("ok", 1.5)], ValueError),
        ([(3, 10)], TypeError),
        ([["ok", 10]], TypeError),
    ],
)
def test_bad_samples_are_refused(sklearn_artifact, tmp_path, samples, error):
    with pytest.raises(error):
        retrain(samples, sklearn_artifact, tmp_path / "x", mode="calibrate")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"samples": [("one prompt", 10)]}, "collect more samples"),
        ({"gate_fraction": 1.0}, "gate_fraction"),
        ({"mode": "guess"}, "mode must be one of"),
    ],
)
def test_bad_requests_are_clear_errors(sklearn_artifact, tmp_path, kwargs, message):
    arguments = {"samples": _samples(60, 1), "mode": "calibrate"} | kwargs
    with pytest.raises(ValueError, match=message):
        retrain(base_artifact=sklearn_artifact, out=tmp_path / "x", **arguments)
    assert not (tmp_path / "x").exists()


def test_retrain_never_overwrites_its_base(sklearn_artifact):
    with pytest.raises(ValueError, match="must differ"):
        retrain(_samples(60, 1), sklearn_artifact, sklearn_artifact, mode="calibrate")
