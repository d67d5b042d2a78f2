from __future__ import annotations

import numpy as np
import pytest

from predictor.buckets import BucketScheme
from predictor.distribution import BucketLengths, bucket_lengths, expected_tokens, p90_tokens

SCHEME = BucketScheme("three", (0.0, 10.0, 100.0, 1000.0))
TABLE = BucketLengths(representatives=(5.0, 50.0, 2000.0), p90=(9, 90, 3000), counts=(1, 1, 1))


def test_bucket_lengths_are_mean_and_p90_of_members():
    lengths = [1, 3, 5, 7, 9, 20, 40, 1500, 2500]  # 5 / 2 / 2 per bucket
    table = bucket_lengths(SCHEME, lengths)
    assert table.representatives == (5.0, 30.0, 2000.0)
    assert table.counts == (5, 2, 2)
    assert table.p90 == (9, 38, 2400)  # ceil of numpy's linear-interpolated percentile


def test_empty_bucket_falls_back_to_its_bounds():
    table = bucket_lengths(SCHEME, [1, 2, 3])
    assert table.representatives == (2.0, 55.0, 550.0)
    assert table.p90[1:] == (100, 1000)
    assert table.counts == (3, 0, 0)


@pytest.mark.parametrize(
    ("probabilities", "expected", "p90"),
    [
        ([1.0, 0.0, 0.0], 5.0, 9),
        ([0.0, 0.0, 1.0], 2000.0, 3000),
        ([0.5, 0.5, 0.0], 27.5, 90),
        ([0.9, 0.1, 0.0], 9.5, 9),  # cumulative reaches 0.9 in the first bucket
        ([0.89, 0.05, 0.06], 4.45 + 2.5 + 120.0, 90),
        ([0.2, 0.2, 0.6], 1 + 10 + 1200.0, 3000),
    ],
)
def test_expected_and_p90_arithmetic(probabilities, expected, p90):
    row = np.array(probabilities)
    assert float(expected_tokens(row, TABLE)) == pytest.approx(expected)
    assert int(p90_tokens(row, TABLE)) == p90


def test_rows_are_handled_independently():
    rows = np.array([[1.0, 0.0, 0.0], [0.0, 0.3, 0.7]])
    assert expected_tokens(rows, TABLE).tolist() == pytest.approx([5.0, 1415.0])
    assert p90_tokens(rows, TABLE).tolist() == [9, 3000]


def test_float_rounding_just_under_the_threshold_still_counts():
    row = np.array([0.3, 0.6 - 1e-9, 0.1 + 1e-9])
    assert int(p90_tokens(row, TABLE)) == 90


def test_table_validation():
    with pytest.raises(ValueError, match="one value per bucket"):
        BucketLengths((1.0, 2.0), (1,), (1, 1))
    with pytest.raises(ValueError, match="finite"):
        BucketLengths((1.0, float("nan")), (1, 2), (1, 1))
