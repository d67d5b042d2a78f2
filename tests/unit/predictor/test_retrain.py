"""Adapting a predictor to served samples: calibrate and retrain modes, the gate's verdict, and
bad input refused before anything is written."""

from __future__ import annotations

import random

import pytest

from predictor.artifact import WEIGHTS_FILE, load_manifest
from predictor.calibration import MIN_SAMPLES
from predictor.finetune import FinetuneConfig, base_finetune_config
from predictor.gate import in_gate_split
from predictor.retrain import (
    VALIDATION_FRACTION,
    RetrainConfig,
    RetrainReport,
    _calibration_records,
    _checked,
    is_held_out,
    retrain,
)
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


def test_retrain_config_sets_epochs_by_the_examples_goal():
    config = RetrainConfig(examples_goal=2400, min_epochs=2, max_epochs=8)
    assert [config.epochs(n) for n in (100, 600, 1000, 5000)] == [8, 4, 3, 2]
    finetune = config.finetune(TINY_FINETUNE, 600, "cuda")
    assert (finetune.epochs, finetune.device, finetune.max_train) == (4, "cuda", 0)
    assert finetune.layers == TINY_FINETUNE.layers  # the shape stays the base's


def test_a_retrain_by_config_takes_the_base_shape(minilm_artifact, tmp_path):
    """Without a whole spec (the gateway's call), the fine-tune gets the base's layers, input
    length and inputs, so the base's weights warm-start it; the config sets the epochs."""
    base = load_manifest(minilm_artifact)
    assert base_finetune_config(base).layers == TINY_FINETUNE.layers != FinetuneConfig().layers
    config = RetrainConfig(examples_goal=1, min_epochs=1, max_epochs=1, warm_start_keep=0.5)
    retrain(_samples(120, seed=3), minilm_artifact, tmp_path / "v2", config=config,
            progress=quiet)  # fmt: skip
    model = LengthPredictor.load(tmp_path / "v2").manifest.training["config"]["model"]
    assert model["epochs"] == 1
    assert model["warm_start_keep"] == 0.5
    shape = ("layers", "max_tokens", "prompt_length_feature")
    assert {k: model[k] for k in shape} == {k: base.training["config"]["model"][k] for k in shape}


def test_calibration_on_the_validation_share(sklearn_artifact, tmp_path):
    """calibration_samples="validation" fits the map on the held-out share of the non-gate
    samples only (when it has enough); a calibrate run always uses them all."""
    samples = _samples(400, seed=5)
    fit = [p for p, _ in samples if not in_gate_split(p)]
    held_out = sum(is_held_out(p, VALIDATION_FRACTION) for p in fit)
    assert held_out >= MIN_SAMPLES
    config = RetrainConfig(calibration_samples="validation")
    records = _checked(samples)
    fit_records = [r for r in records if not in_gate_split(r.prompt)]
    assert len(_calibration_records(fit_records, "retrain", config)) == held_out
    assert len(_calibration_records(fit_records, "calibrate", config)) == len(fit)
    few = fit_records[:100]  # too few held out: the whole fit share
    assert len(_calibration_records(few, "retrain", config)) == len(few)
