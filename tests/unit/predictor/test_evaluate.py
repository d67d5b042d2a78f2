from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr  # type: ignore[import-untyped]

from predictor.buckets import BucketScheme
from predictor.evaluate import (
    average_ranks,
    kendall_tau,
    length_scores,
    majority_bucket,
    score,
    score_mean,
    spearman,
)
from predictor.prepare import LabeledRecord

SCHEME = BucketScheme("three", (0.0, 10.0, 100.0, 1000.0))


@pytest.mark.parametrize("seed", range(5))
def test_spearman_matches_scipy_with_ties(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 8, 200).astype(float)  # many ties
    b = a + rng.normal(0, 3, 200)
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic)


def test_average_ranks_share_ties():
    assert average_ranks(np.array([10.0, 20.0, 10.0, 30.0])).tolist() == [1.5, 3.0, 1.5, 4.0]


def test_constant_prediction_ranks_nothing():
    assert spearman(np.full(5, 3.0), np.arange(5.0)) == 0.0
    assert spearman(np.array([1.0]), np.array([2.0])) == 0.0
    assert kendall_tau(np.full(5, 3.0), np.arange(5.0)) == 0.0


def test_kendall_tau_counts_pairs_in_order_and_out_of_it():
    # 6 pairs: 5 in order, 1 swapped (2 and 3): (5 - 1) / 6.
    assert kendall_tau(np.array([1.0, 3.0, 2.0, 4.0]), np.arange(4.0)) == pytest.approx(4 / 6)
    assert kendall_tau(np.arange(4.0), -np.arange(4.0)) == pytest.approx(-1.0)


def test_length_scores_rank_and_size_predictions():
    scores = length_scores(np.array([10.0, 20.0, 40.0]), np.array([15, 30, 40]), [12, 35, 30])
    assert scores["kendall_tau"] == pytest.approx(1 / 3)
    assert scores["mae_tokens"] == pytest.approx((2 + 15 + 10) / 3)
    assert scores["p90_coverage"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="one"):
        length_scores(np.array([1.0]), np.array([1.0]), [1, 2])


def test_score_arithmetic():
    lengths = [5, 50, 500, 5]  # true buckets 0, 1, 2, 0
    predicted = np.array([0, 2, 2, 1])
    tokens = np.array([5.0, 60.0, 400.0, 15.0])
    result = score(SCHEME, lengths, predicted, tokens, majority=0)
    assert result.accuracy == 0.5
    assert result.within_one == 1.0
    assert result.majority_baseline == 0.5
    assert result.mae_tokens == pytest.approx((0 + 10 + 100 + 10) / 4)
    assert result.spearman == pytest.approx(spearmanr(tokens, lengths).statistic)
    assert result.n == 4


def test_majority_bucket_comes_from_training_lengths():
    assert majority_bucket(SCHEME, [1, 2, 50, 60, 70]) == 1


def test_mean_line_predicts_the_training_mean_everywhere():
    records = [LabeledRecord(f"t:{i}", "t", "p", n) for i, n in enumerate([5, 50, 500])]
    result = score_mean(SCHEME, [10, 20, 30], records, majority=1)
    assert result.mae_tokens == pytest.approx((15 + 30 + 480) / 3)
    assert result.accuracy == pytest.approx(1 / 3)  # bucket of 20 is 1
    assert result.spearman == 0.0


def test_empty_test_set_is_refused():
    with pytest.raises(ValueError, match="empty"):
        score(SCHEME, [], np.zeros(0, dtype=int), np.zeros(0), 0)
