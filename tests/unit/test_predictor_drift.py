"""The rolling error of a predictor on served traffic and the rule that calls it drifted."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from gateway.admin.retrain_worker import missing_training_stack
from gateway.drift_settings import DriftSettings, RetrainSettings
from gateway.prediction.drift import DriftRule, RollingError, ranks, rolling_error, spearman
from gateway.settings import SettingsError
from predictor.evaluate import spearman as numpy_spearman


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], []),
        ([5.0], [1.0]),
        ([3.0, 1.0, 2.0], [3.0, 1.0, 2.0]),
        ([1.0, 2.0, 2.0, 3.0], [1.0, 2.5, 2.5, 4.0]),
        ([7.0, 7.0, 7.0], [2.0, 2.0, 2.0]),
    ],
)
def test_ranks_share_ties(values: list[float], expected: list[float]) -> None:
    assert ranks(values) == expected


@pytest.mark.parametrize("seed", range(5))
def test_spearman_matches_the_predictors_evaluation_with_ties(seed: int) -> None:
    """The gateway's pure-Python Spearman agrees with the one the gate and benches use."""
    rng = random.Random(seed)
    xs = [float(rng.randint(1, 20)) for _ in range(200)]  # many ties
    ys = [x * rng.uniform(0.5, 2.0) + rng.randint(0, 30) for x in xs]
    expected = numpy_spearman(np.array(xs), np.array(ys))
    assert spearman(xs, ys) == pytest.approx(expected, abs=1e-12)
    assert abs(expected) > 0.3  # a correlation worth comparing


@pytest.mark.parametrize(
    ("pairs", "mae", "baseline", "ratio", "rho"),
    [
        # A perfect predictor: no error, perfect ranking.
        ([(10, 10), (20, 20), (30, 30)], 0.0, 20 / 3, 0.0, 1.0),
        # The served mean itself: as good as the baseline, and ranks nothing.
        ([(20, 10), (20, 20), (20, 30)], 20 / 3, 20 / 3, 1.0, 0.0),
        # Right order, 4x too low (the reference predictor on a chatty model).
        ([(25, 100), (50, 200), (75, 300)], 150.0, 200 / 3, 2.25, 1.0),
        # Reversed order, right scale.
        ([(30, 10), (20, 20), (10, 30)], 40 / 3, 20 / 3, 2.0, -1.0),
        # Every answer one length: any error is worse than the constant.
        ([(5, 10), (15, 10)], 5.0, 0.0, math.inf, 0.0),
        ([(10, 10), (10, 10)], 0.0, 0.0, 1.0, 0.0),
    ],
)
def test_rolling_error(
    pairs: list[tuple[int, int]], mae: float, baseline: float, ratio: float, rho: float
) -> None:
    error = rolling_error(pairs)
    assert error is not None
    assert error.samples == len(pairs)
    assert error.mae_tokens == pytest.approx(mae)
    assert error.served_mean_mae_tokens == pytest.approx(baseline)
    assert error.mae_ratio == pytest.approx(ratio)
    assert error.spearman == pytest.approx(rho)


def test_an_empty_window_has_no_error() -> None:
    assert rolling_error([]) is None


def _error(samples: int, ratio: float, rho: float) -> RollingError:
    return RollingError(samples, 100.0 * ratio, 100.0, ratio, rho, 50.0, 60.0)


RULE = DriftRule(min_samples=100, max_mae_ratio=1.0, min_spearman=0.1)


@pytest.mark.parametrize(
    ("error", "drifted", "says"),
    [
        (None, False, "0 samples < 100"),
        (_error(99, 3.0, -0.5), False, "99 samples < 100"),  # too few to judge, however bad
        (_error(100, 0.7, 0.6), False, "MAE 0.70x"),
        (_error(100, 1.0, 0.6), True, "MAE 1.00x the served mean's >= 1.0"),  # at the threshold
        (_error(500, 2.5, 0.6), True, "MAE 2.50x"),
        (_error(500, 0.9, 0.05), True, "Spearman 0.050 < 0.1"),
        (_error(500, 1.4, 0.0), True, "MAE 1.40x the served mean's >= 1.0; Spearman"),
        (_error(500, math.inf, 0.0), True, "MAE infx"),
        (_error(500, 0.99, 0.1), False, "Spearman 0.100"),  # the floor itself passes
    ],
)
def test_drift_rule(error: RollingError | None, drifted: bool, says: str) -> None:
    verdict, reason = RULE.verdict(error)
    assert verdict is drifted
    assert says in reason


@pytest.mark.parametrize(
    ("settings", "variables", "message"),
    [
        (DriftSettings, {"min_samples": 600}, "MIN_SAMPLES must be <="),
        (DriftSettings, {"window_samples": 0}, "GATEWAY_DRIFT_WINDOW_SAMPLES must be >= 1"),
        (DriftSettings, {"min_spearman": 1.5}, "between -1 and 1"),
        (DriftSettings, {"refresh_s": 0.0}, "GATEWAY_DRIFT_REFRESH_S > 0"),
        (RetrainSettings, {"mode": "finetune"}, "GATEWAY_RETRAIN_MODE must be one of"),
        (RetrainSettings, {"job_timeout_s": 0.0}, "GATEWAY_RETRAIN_JOB_TIMEOUT_S > 0"),
    ],
)
def test_bad_settings_are_refused(
    settings: type[DriftSettings] | type[RetrainSettings],
    variables: dict[str, object],
    message: str,
) -> None:
    with pytest.raises(SettingsError, match=message):
        settings(**variables)  # type: ignore[arg-type]


def test_a_gateway_without_the_training_stack_leaves_jobs_to_a_trainer() -> None:
    assert missing_training_stack(("json", "no_such_training_package")) == [
        "no_such_training_package"
    ]
    assert missing_training_stack(("json",)) == []
