"""The ranking head: its losses, its training, its score map and the artifact that carries it."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from predictor.artifact import MANIFEST_FILE, ArtifactError, load_manifest
from predictor.calibrate import write_calibrated
from predictor.calibration import fit_calibration
from predictor.evaluate import kendall_tau
from predictor.rank_build import (
    RankBuildError,
    build_ranking_artifact,
    reusable_ranking,
    unseen_records,
    validation_scores,
)
from predictor.ranking import (
    RankConfig,
    RankHead,
    listmle_loss,
    pairwise_loss,
    tie_groups,
    train_rank_head,
)
from predictor.runtime import LengthPredictor
from predictor.score_map import RAMP_TOKENS, fit_score_map
from predictor.training import TrainingSet, TrainSpec, train_artifact
from tests.unit.predictor.conftest import TINY_FINETUNE, synthetic_records

TINY_RANK = RankConfig(max_train=0, list_size=8, lists_per_step=2, epochs=6, hidden=16)


def test_listmle_is_the_plackett_luce_likelihood_of_the_true_order() -> None:
    scores = torch.tensor([0.5, 2.0, -1.0])
    groups = torch.tensor([1, 3, 0])  # true order, longest first: items 1, 0, 2
    s1, s0, s2 = 2.0, 0.5, -1.0
    want = (
        math.log(math.exp(s1) + math.exp(s0) + math.exp(s2))
        - s1
        + math.log(math.exp(s0) + math.exp(s2))
        - s0
    ) / 3
    assert float(listmle_loss(scores, groups)) == pytest.approx(want, rel=1e-6)
    # The true order scores better than the reverse one; a batch of lists is their mean.
    assert float(listmle_loss(-scores, groups)) > float(listmle_loss(scores, groups))
    both = listmle_loss(torch.stack([scores, -scores]), torch.stack([groups, groups]))
    mean = (listmle_loss(scores, groups) + listmle_loss(-scores, groups)) / 2
    assert float(both) == pytest.approx(float(mean), rel=1e-6)


def test_pairwise_loss_counts_only_untied_pairs_inside_the_margin() -> None:
    groups = tie_groups(torch.tensor([5, 7, 300]), 10)  # 5 and 7 tie
    assert groups.tolist() == [0, 0, 30]
    assert float(pairwise_loss(torch.tensor([0.0, 0.2, 9.0]), groups, 0.5)) == 0.0
    # The longest answer scored below the others: both its pairs violate (margin 0.5).
    loss = pairwise_loss(torch.tensor([0.0, 0.0, -1.0]), groups, 0.5)
    assert float(loss) == pytest.approx(1.5)
    assert float(pairwise_loss(torch.zeros(3), torch.zeros(3, dtype=torch.long), 0.5)) == 0.0


def test_the_head_starts_as_the_classifiers_own_order() -> None:
    head = RankHead(5, 4)
    log_expected = torch.tensor([3.0, 1.0, 2.0])
    assert torch.equal(head(torch.randn(3, 5), log_expected), log_expected)


def synthetic_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lengths driven by a feature the classifier's estimate does not see."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, 6)).astype(np.float32)
    truth = 200 * np.exp(features[:, 0])
    lengths = np.maximum(1, truth * rng.uniform(0.8, 1.25, n)).astype(np.int64)
    log_expected = rng.normal(5, 0.1, n).astype(np.float32)  # an estimate that knows nothing
    return features, log_expected, lengths


def test_training_learns_what_the_classifier_missed_and_keeps_the_best_epoch() -> None:
    features, log_expected, lengths = synthetic_rows(1200, 0)
    config = replace(TINY_RANK, epochs=8)
    head, stats = train_rank_head(features, log_expected, lengths, config, progress=lambda _: None)
    assert stats.holdout_loss < stats.holdout_loss_start
    assert 1 <= stats.best_epoch <= stats.epochs
    test_features, test_log_expected, test_lengths = synthetic_rows(400, 1)
    with torch.no_grad():
        scores = head(torch.from_numpy(test_features), torch.from_numpy(test_log_expected))
    assert kendall_tau(scores.numpy(), test_lengths) > 0.5
    assert kendall_tau(test_log_expected, test_lengths) < 0.1


def test_training_without_signal_keeps_the_starting_order() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 1000, 600)
    log_expected = np.log(lengths).astype(np.float32)  # already the true order
    noise = rng.normal(size=(600, 4)).astype(np.float32)
    head, stats = train_rank_head(noise, log_expected, lengths, TINY_RANK, lambda _: None)
    with torch.no_grad():
        scores = head(torch.from_numpy(noise), torch.from_numpy(log_expected))
    assert kendall_tau(scores.numpy(), lengths) > 0.95
    assert stats.holdout_loss <= stats.holdout_loss_start


def test_bad_training_input_is_refused() -> None:
    features, log_expected, lengths = synthetic_rows(100, 0)
    with pytest.raises(ValueError, match="one row per prompt"):
        train_rank_head(features, log_expected[:-1], lengths, TINY_RANK)
    with pytest.raises(ValueError, match="at least"):
        train_rank_head(features[:10], log_expected[:10], lengths[:10], TINY_RANK)
    with pytest.raises(ValueError, match="loss"):
        RankConfig(loss="regression")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="length_weight"):
        RankConfig(loss="pointwise", length_weight=0.0)


def test_the_score_map_keeps_every_distinct_score_apart() -> None:
    rng = np.random.default_rng(0)
    scores = rng.normal(size=3000)
    lengths = np.where(rng.random(3000) < 0.3, 1024, np.exp(5 + scores + rng.normal(size=3000)))
    lengths = np.minimum(lengths, 1024).astype(np.int64)
    fitted = fit_score_map(scores, lengths)
    expected, p90 = fitted.apply(np.sort(scores))
    assert (np.diff(expected) > 0).all()  # strictly: no ties for shortest-first
    assert (p90 >= expected).all()
    plain, _ = fit_calibration(scores, lengths).apply(np.sort(scores))
    assert (np.diff(plain) == 0).any()  # isotonic regression alone pools blocks
    assert np.abs(expected - plain).max() <= RAMP_TOKENS + 1e-9


@pytest.fixture(scope="module")
def ranked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, TrainingSet]:
    """A tiny classifier trained on a subsample, and a ranking head built on it."""
    root = tmp_path_factory.mktemp("ranked")
    data = TrainingSet(synthetic_records(240, seed=1), synthetic_records(48, seed=2, corpus="val"))
    finetune = replace(TINY_FINETUNE, max_train=80, epochs=2, prompt_length_feature=True)
    spec = TrainSpec("minilm", "quantile_n10", finetune=finetune)
    train_artifact(spec, data, root / "base", progress=lambda _: None)
    build_ranking_artifact(root / "base", root / "rank", data, TINY_RANK, progress=lambda _: None)
    return root / "base", root / "rank", data


def test_the_ranking_artifact_serves_lengths_in_its_scores_order(ranked) -> None:
    base_dir, rank_dir, data = ranked
    manifest = load_manifest(rank_dir)
    assert manifest.ranking is not None
    assert manifest.ranking.loss == "pairwise"
    assert manifest.kind == "minilm"
    assert manifest.training["ranking"]["head_records"] == 160
    assert manifest.scheme == load_manifest(base_dir).scheme
    predictor = LengthPredictor.load(rank_dir)
    assert predictor.ranks
    assert not LengthPredictor.load(base_dir).ranks
    prompts = [r.prompt for r in data.validation]
    lengths = predictor.lengths(prompts)
    scores = predictor.scores(prompts)
    np.testing.assert_allclose(lengths.rank_score, scores)
    low, high = manifest.ranking.lengths.expected.x[0], manifest.ranking.lengths.expected.x[-1]
    inside = (scores > low) & (scores < high)
    order = np.argsort(scores[inside])
    assert (np.diff(lengths.expected_tokens[inside][order]) >= 0).all()
    assert (lengths.p90_tokens >= np.floor(lengths.expected_tokens)).all()
    one = predictor.predict_batch(prompts[:3])  # the same batch: int8 depends on batch-mates
    three = predictor.lengths(prompts[:3])
    assert [p.expected_tokens for p in one] == pytest.approx(three.expected_tokens)
    assert [p.rank_score for p in one] == pytest.approx(three.rank_score)
    assert all(abs(sum(p.probabilities) - 1) < 1e-5 for p in one)
    # The manifest's metrics are those of the file that ships, through the same runtime.
    assert manifest.metrics["validation"] == validation_scores(predictor, data.validation)


def test_a_classifier_reports_its_expected_length_as_its_rank(ranked) -> None:
    base_dir, _, data = ranked
    predictor = LengthPredictor.load(base_dir)
    prompts = [r.prompt for r in data.validation[:5]]
    lengths = predictor.lengths(prompts)
    np.testing.assert_allclose(lengths.rank_score, predictor.raw_expected(prompts))
    with pytest.raises(ArtifactError, match="no ranking head"):
        predictor.scores(prompts)


def test_a_calibrated_ranking_artifact_keeps_its_head(ranked, tmp_path: Path) -> None:
    _, rank_dir, data = ranked
    predictor = LengthPredictor.load(rank_dir)
    prompts = [r.prompt for r in data.train] * 2
    raw = predictor.raw_expected(prompts)
    calibration = fit_calibration(raw * 2, [r.length for r in data.train] * 2)
    write_calibrated(rank_dir, tmp_path / "cal", calibration)
    calibrated = LengthPredictor.load(tmp_path / "cal")
    assert calibrated.ranks
    want, _ = calibration.apply(predictor.raw_expected(prompts[:4]))
    assert calibrated.lengths(prompts[:4]).expected_tokens == pytest.approx(want)


def test_the_head_learns_only_from_prompts_its_classifier_never_saw(ranked) -> None:
    base_dir, _, data = ranked
    base = load_manifest(base_dir)
    unseen = unseen_records(base, data.train)
    assert len(unseen) == 160
    with pytest.raises(RankBuildError, match="other records"):
        unseen_records(base, data.train[1:])


def test_reuse_needs_the_same_base_and_configuration(ranked) -> None:
    base_dir, rank_dir, _ = ranked
    base = load_manifest(base_dir)
    assert reusable_ranking(rank_dir, base, TINY_RANK) is not None
    assert reusable_ranking(rank_dir, base, replace(TINY_RANK, hidden=17)) is None
    assert reusable_ranking(rank_dir, replace(base, version="other"), TINY_RANK) is None


def test_a_ranking_head_needs_a_classifier_with_weights_and_unseen_prompts(
    ranked, tmp_path: Path
) -> None:
    base_dir, rank_dir, data = ranked
    with pytest.raises(RankBuildError, match="already has a ranking head"):
        build_ranking_artifact(rank_dir, tmp_path / "x", data, TINY_RANK, progress=print)
    few = replace(TINY_RANK, max_train=50)
    with pytest.raises(RankBuildError, match="did not see"):
        build_ranking_artifact(base_dir, tmp_path / "y", data, few, progress=print)
    assert not (tmp_path / "x").exists()
    assert not (tmp_path / "y").exists()


def test_a_manifest_naming_a_missing_score_output_is_refused(ranked, tmp_path: Path) -> None:
    import shutil

    _, rank_dir, _ = ranked
    broken = tmp_path / "broken"
    shutil.copytree(rank_dir, broken)
    data = json.loads((broken / MANIFEST_FILE).read_text())
    data["ranking"]["output"] = "length_logits"
    (broken / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="length_logits"):
        LengthPredictor.load(broken)
    data["kind"] = "sklearn"
    (broken / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="needs a MiniLM graph"):
        load_manifest(broken)


def test_the_gateways_retrain_modes_work_from_a_ranking_artifact(ranked, tmp_path: Path) -> None:
    from predictor.retrain import retrain

    _, rank_dir, data = ranked
    samples = [(r.prompt + f" #{i}", r.length * 2) for i, r in enumerate(data.train[:150])]
    calibrated = retrain(samples, rank_dir, tmp_path / "cal", mode="calibrate", progress=print)
    assert LengthPredictor.load(tmp_path / "cal").ranks  # the head and its order are kept
    assert calibrated.mode == "calibrate"
    # A retrain fine-tunes the classifier from its weights (the base's, shipped as they were):
    # the candidate is a classifier, which the gate judges against the ranking version.
    finetune = replace(TINY_FINETUNE, prompt_length_feature=True, epochs=1)
    spec = TrainSpec("minilm", "quantile_n10", finetune=finetune)
    retrain(samples, rank_dir, tmp_path / "re", spec=spec, progress=print)
    again = LengthPredictor.load(tmp_path / "re")
    assert not again.ranks
    assert again.manifest.training["warm_start"].endswith("weights.safetensors")


def test_the_gateway_serves_a_ranking_artifact_as_any_other(ranked) -> None:
    import asyncio

    from gateway.prediction.lifecycle import load_predictor
    from gateway.prediction.service import Prediction, PredictorService

    _, rank_dir, data = ranked
    prompts = [r.prompt for r in data.validation[:4]]

    async def served() -> list[Prediction | None]:
        service = PredictorService(load_predictor(rank_dir), loader=load_predictor)
        service.start()
        try:
            return [await service.predict(p) for p in prompts]
        finally:
            await service.stop()

    predictions = asyncio.run(served())
    direct = LengthPredictor.load(rank_dir, threads=1)
    for prompt, prediction in zip(prompts, predictions, strict=True):
        want = direct.lengths([prompt])
        assert prediction is not None
        assert prediction.tokens == max(1, round(float(want.expected_tokens[0])))
        assert prediction.p90_tokens == int(want.p90_tokens[0])
        assert 1 <= prediction.within(64) <= 64
