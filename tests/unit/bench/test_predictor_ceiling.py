"""The accuracy-ceiling bench's decision rule and bookkeeping, on hand-made probabilities."""

from __future__ import annotations

import numpy as np

from bench.predictor.ceiling import ceiling
from predictor.decision import BucketDecision

PROBABILITIES = np.array(
    [
        [0.9, 0.1, 0.0],
        [0.6, 0.4, 0.0],
        [0.45, 0.55, 0.0],
        [0.2, 0.1, 0.7],
    ]
)


def test_ceiling_finds_the_bias_the_labels_reward_and_counts_the_non_zero_answers():
    buckets = np.array([0, 1, 1, 2])  # the second prompt needs a bias away from bucket 0
    expected_lengths = np.array([10.0, 60.0, 80.0, 300.0])
    row = ceiling(PROBABILITIES, buckets, expected_lengths, BucketDecision(0, 1.0))
    assert row["majority_rate"] == 0.25
    assert row["argmax_accuracy"] == 0.75
    assert (row["fitted_log_bias"], row["fitted_accuracy"]) == (1.0, 0.5)  # names [0, 0, 0, 2]
    assert row["best_accuracy_tuned_on_test"] == 1.0
    # Any bias in (log(0.1 / 0.9), log(0.4 / 0.6)) = (-2.20, -0.41) is right on all four.
    assert -2.2 < row["best_bias"] < -0.4
    assert row["predicted_not_bucket0"] == 2
    assert row["correct_when_not_bucket0"] == 1.0
    assert row["bucket0_share_of_longest_ranked"]["top_10%"] == 0.0  # the 300-token prompt
