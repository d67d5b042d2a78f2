"""The tokens a running request is still expected to produce.

What site_engine/engine/core/remaining.py computes.
"""

from __future__ import annotations

import math

import pytest

from site_engine.engine.core.remaining import OUTRUN_SHARE, remaining_tokens
from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.types import SamplingParams


@pytest.mark.parametrize(
    ("predicted", "produced", "max_tokens", "expected"),
    [
        (100, 0, 1024, 100),  # nothing produced: the prediction
        (100, 40, 1024, 60),  # before the prediction: its remainder
        (100, 99, 1024, 1),  # one short of it
        (100, 100, 1024, max(math.ceil(OUTRUN_SHARE * 100), 1)),  # reached: past it
        (100, 300, 1024, math.ceil(OUTRUN_SHARE * 300)),  # far past: grows with what ran
        (100, 1000, 1024, 24),  # never beyond what max_tokens allows
        (100, 1024, 1024, 0),  # max_tokens reached: nothing left
        (1, 0, 1, 1),
        (1, 1, 1, 0),
    ],
)
def test_remaining_tokens(predicted: int, produced: int, max_tokens: int, expected: int) -> None:
    assert remaining_tokens(predicted, produced, max_tokens) == expected


def test_a_request_past_its_prediction_counts_more_the_longer_it_runs() -> None:
    left = [remaining_tokens(50, produced, 100_000) for produced in range(50, 2000, 50)]
    assert left == sorted(left)
    assert left[0] >= 1
    assert left[-1] > left[0]


def test_sequence_reports_the_rule() -> None:
    seq = Sequence("a", (1, 2, 3), SamplingParams(max_tokens=64), predicted_tokens=4)
    assert seq.remaining_predicted_tokens == 4
    seq.output_token_ids.extend([7] * 10)
    assert (
        seq.remaining_predicted_tokens
        == remaining_tokens(4, 10, 64)
        == min(max(math.ceil(OUTRUN_SHARE * 10), 1), 54)
    )
