"""The activation gate's verdict, table-driven: a candidate must clearly beat every rival."""

from __future__ import annotations

import numpy as np
import pytest

from predictor.gate import Predictions, clearly_better, decide, in_gate_split

RNG = np.random.default_rng(0)
TRUTH = RNG.integers(10, 600, 300).astype(np.float64)


def near(noise: float) -> Predictions:
    """Predictions off the truth by about `noise` tokens (a fixed draw per noise level)."""
    rng = np.random.default_rng(int(noise))
    expected = TRUTH + rng.normal(0, noise, TRUTH.size)
    return Predictions(expected, expected * 1.5)


MEAN = Predictions(np.full(TRUTH.size, TRUTH.mean()), np.full(TRUTH.size, 550.0))


@pytest.mark.parametrize(
    ("candidate", "rivals", "activate", "named"),
    [
        (near(20), {"served_mean": MEAN}, True, ""),
        (near(20), {"served_mean": MEAN, "active": near(80)}, True, ""),
        (near(80), {"served_mean": MEAN, "active": near(20)}, False, "active"),
        (MEAN, {"served_mean": MEAN}, False, "served_mean"),  # a tie is not a win
        (near(400), {"served_mean": MEAN, "tfidf": near(100)}, False, "served_mean"),
        (near(21), {"active": near(20)}, False, "active"),  # noise-level gains are not enough
    ],
)
def test_decide(candidate, rivals, activate, named) -> None:
    decision = decide(candidate, rivals, TRUTH)
    assert decision.activate is activate
    assert named in decision.reason
    assert set(decision.rivals) == set(rivals)
    assert decision.to_json()["candidate"]["samples"] == TRUTH.size


def test_a_gate_needs_a_rival() -> None:
    with pytest.raises(ValueError, match="at least one rival"):
        decide(near(10), {}, TRUTH)


def test_clearly_better_is_a_one_sided_paired_test() -> None:
    truth = np.arange(100, dtype=np.float64)
    assert clearly_better(truth + 1, truth + 5, truth)
    assert not clearly_better(truth + 5, truth + 1, truth)
    assert not clearly_better(truth + 1, truth + 1, truth)
    assert not clearly_better(truth[:1], truth[:1] + 3, truth[:1])  # one sample decides nothing


def test_the_gate_split_is_stable_and_about_its_fraction() -> None:
    prompts = [f"prompt {i}" for i in range(4000)]
    chosen = [in_gate_split(p) for p in prompts]
    assert chosen == [in_gate_split(p) for p in prompts]
    assert 0.17 < sum(chosen) / len(chosen) < 0.23
