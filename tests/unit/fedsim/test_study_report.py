"""The routing study's summary: ratios paired by seed, and a verdict only beyond the spread."""

from __future__ import annotations

import math
from typing import Any

from fedsim.study_report import Table, merge, resolution, summarize


def _seeds(xs: list[float]) -> dict[str, float]:
    return {str(i): x for i, x in enumerate(xs)}


def _table(cc: list[float], rr: list[float], lr: list[float]) -> Table:
    arms = {"completion_cost": cc, "round_robin": rr, "least_requests": lr}
    return {"4_unequal_x": {arm: _seeds(xs) for arm, xs in arms.items()}}


def test_a_predicted_arm_wins_only_when_every_seed_beats_the_strongest_load_only_arm() -> None:
    tie = resolution(1.2, 3)
    assert math.isclose(tie, 0.025)
    s = summarize(_table([110, 120, 130], [100, 100, 100], [100, 110, 120]), "completion_cost", tie)
    case = s["cases"]["4_unequal_x"]
    assert case["strongest_load_only"] == "least_requests"
    v = case["predicted_vs_strongest_load_only"]["completion_cost"]
    assert v["by_seed"] == [1.1, 120 / 110, 130 / 120]
    assert v["verdict"] == "wins"
    assert case["min_max"]["completion_cost"] == [110, 130]
    assert math.isclose(s["default_vs_round_robin_min"], 1.2)
    assert math.isclose(s["default_vs_round_robin_seed_min"], 1.1)
    # One seed within the bisection's resolution: no claim.
    s = summarize(_table([110, 121, 130], [100] * 3, [100, 120, 120]), "completion_cost", tie)
    v = s["cases"]["4_unequal_x"]["predicted_vs_strongest_load_only"]["completion_cost"]
    assert v["verdict"] == "within spread"
    s = summarize(_table([90, 90, 90], [100] * 3, [100, 100, 100]), "completion_cost", tie)
    v = s["cases"]["4_unequal_x"]["predicted_vs_strongest_load_only"]["completion_cost"]
    assert v["verdict"] == "loses"


def test_merge_joins_arms_of_one_case_run_by_separate_studies() -> None:
    base: dict[str, Any] = {
        "default": "completion_cost",
        "slo": {"ttft_p99_s": 2.0, "tpot_p99_s": 0.1},
    }
    whole = _table([110, 120, 130], [100] * 3, [100] * 3)["4_unequal_x"]
    a: dict[str, Any] = base | {
        "command": "python -m fedsim.study --grow 1.2 --bisection-steps 3",
        "arms": ["completion_cost"],
        "cases": {"4_unequal_x": {}},
        "goodput_rps": {"4_unequal_x": {"completion_cost": whole["completion_cost"]}},
        "runs": {},
    }
    b: dict[str, Any] = base | {
        "command": "python -m fedsim.study",
        "grow": 2.0,
        "bisection_steps": 4,
        "arms": ["round_robin", "least_requests"],
        "cases": {"4_unequal_x": {}},
        "goodput_rps": {"4_unequal_x": {k: whole[k] for k in ("round_robin", "least_requests")}},
        "runs": {},
    }
    payload = merge([a, b])
    assert payload["arms"] == ["completion_cost", "round_robin", "least_requests"]
    assert payload["summary"]["tie_resolution"] == max(resolution(1.2, 3), resolution(2.0, 4))
    assert math.isclose(payload["default_vs_round_robin_min"], 1.2)


def test_an_arm_is_compared_with_itself_without_a_prediction_seed_by_seed() -> None:
    table = _table([110, 120, 130], [100] * 3, [100] * 3)
    table["4_unequal_x"]["completion_cost@none"] = _seeds([110, 118, 131])
    case = summarize(table, "completion_cost", resolution(1.2, 3))["cases"]["4_unequal_x"]
    v = case["arm_vs_no_prediction"]["completion_cost"]
    assert v["by_seed"] == [1.0, 120 / 118, 130 / 131]
    assert v["verdict"] == "within spread"
