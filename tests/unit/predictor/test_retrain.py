from __future__ import annotations

import pytest

from predictor.artifact import load_manifest
from predictor.retrain import RetrainReport, is_held_out, retrain
from predictor.runtime import LengthPredictor
from predictor.training import TrainSpec
from tests.unit.predictor.conftest import TINY_FINETUNE, synthetic_records


def _samples(n: int, seed: int) -> list[tuple[str, int]]:
    # Shifted lengths: the served model answers longer than the corpora did.
    return [(r.prompt + f" #{i}", r.length * 2) for i, r in enumerate(synthetic_records(n, seed))]


def test_retrain_writes_a_loadable_version_and_reports(sklearn_artifact, tmp_path):
    out = tmp_path / "v2"
    samples = _samples(80, seed=7)
    report = retrain(
        samples,
        sklearn_artifact,
        out,
        mix_base_data=False,
        holdout_fraction=0.25,
        progress=lambda _: None,
    )
    assert isinstance(report, RetrainReport)
    assert report.samples == 80
    assert report.train_samples + report.holdout_samples == 80
    assert report.holdout_samples == sum(is_held_out(p, 0.25) for p, _ in samples)
    assert report.base_records_mixed == 0
    new = LengthPredictor.load(out)
    base = load_manifest(sklearn_artifact)
    assert report.new_version == new.version != base.version
    assert report.base_version == base.version
    assert new.manifest.scheme == base.scheme  # same edges: predictions mean the same
    assert new.manifest.training["parent_version"] == base.version
    assert report.new.n == report.current.n == report.holdout_samples
    # The base never saw the doubled lengths; the new version learned them.
    assert report.new.mae_tokens < report.current.mae_tokens
    assert report.better, report.reason


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
        retrain(samples, sklearn_artifact, tmp_path / "x", mix_base_data=False)
    assert not (tmp_path / "x").exists()


def test_too_few_samples_is_a_clear_error(sklearn_artifact, tmp_path):
    with pytest.raises(ValueError, match="collect more samples"):
        retrain([("one prompt", 10)], sklearn_artifact, tmp_path / "x", mix_base_data=False)


def test_holdout_fraction_must_be_a_fraction(sklearn_artifact, tmp_path):
    with pytest.raises(ValueError, match="holdout_fraction"):
        retrain(_samples(10, 1), sklearn_artifact, tmp_path / "x", holdout_fraction=1.0)


def test_retrain_never_overwrites_its_base(sklearn_artifact):
    with pytest.raises(ValueError, match="must differ"):
        retrain(_samples(40, 1), sklearn_artifact, sklearn_artifact, mix_base_data=False)


def test_retrain_of_a_minilm_base_keeps_its_kind_and_edges(minilm_artifact, tmp_path):
    spec = TrainSpec("minilm", finetune=TINY_FINETUNE)
    report = retrain(
        _samples(60, seed=3),
        minilm_artifact,
        tmp_path / "v2",
        mix_base_data=False,
        holdout_fraction=0.3,
        spec=spec,
        progress=lambda _: None,
    )
    new = LengthPredictor.load(tmp_path / "v2")
    assert new.manifest.kind == "minilm"
    assert new.manifest.scheme == load_manifest(minilm_artifact).scheme
    assert new.manifest.training["records_used"] == report.train_samples * TINY_FINETUNE.epochs
