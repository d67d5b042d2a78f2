"""The multi-site benchmark's arithmetic: imbalance, ratios, and what a run and a cell report."""

from __future__ import annotations

import pytest

from bench.multisite.counters import SiteCounters
from bench.multisite.metrics import (
    BASELINE,
    CONFIGS,
    Cell,
    build_run,
    imbalance,
    overall_kv_reduction,
    ratio,
    reduction,
)
from bench.multisite.replay import Outcome


@pytest.mark.parametrize(
    ("per_site", "expected"),
    [
        ([100, 100, 100], 1.0),
        ([300, 0, 0], 3.0),
        ([150, 50], 1.5),
        ([0, 0], 0.0),
        ([], 0.0),
    ],
)
def test_imbalance_is_max_over_mean(per_site: list[int], expected: float) -> None:
    assert imbalance(per_site) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("baseline", "value", "speedup", "saved"),
    [(200, 100, 2.0, 0.5), (100, 100, 1.0, 0.0), (100, 125, 0.8, -0.25), (0, 10, 0.0, 0.0)],
)
def test_ratio_and_reduction(baseline: int, value: int, speedup: float, saved: float) -> None:
    assert ratio(baseline, value) == pytest.approx(speedup)
    assert reduction(baseline, value) == pytest.approx(saved)


def test_ratio_of_nothing_is_zero_not_a_crash() -> None:
    assert ratio(10, 0) == 0.0


def outcome(query: str, site: str | None, prompt: int, completion: int, status: int = 200):
    error = None if status == 200 else "boom"
    return Outcome(query, status, site, prompt, completion, 0.1, error)


def counters(iterations: int, kv: int) -> SiteCounters:
    return SiteCounters(iterations, kv // 16, kv)


def test_a_run_counts_tokens_per_site_including_idle_sites_and_failures() -> None:
    run = build_run(
        "mico",
        max_batch=4,
        outcomes=[
            outcome("a", "s1", 10, 30),
            outcome("b", "s1", 5, 5),
            outcome("c", "s2", 20, 20),
            outcome("d", None, 0, 0, status=502),
        ],
        wall_s=2.0,
        counters={"s1": counters(50, 900), "s2": counters(40, 700), "s3": counters(0, 0)},
    )
    assert (run.queries, run.completed, run.failed) == (4, 3, 1)
    assert run.tokens_served == {"s1": 50, "s2": 40, "s3": 0}
    assert run.queries_served == {"s1": 2, "s2": 1, "s3": 0}
    assert run.makespan_iterations == 50  # the busiest site decides
    assert run.total_iterations == 90
    assert run.kv_tokens == 1600
    assert run.imbalance == pytest.approx(50 / 30)
    assert run.errors == ("boom",)
    summary = run.summary()
    assert summary["per_site"]["s3"] == {  # type: ignore[index]
        "iterations": 0,
        "kv_token_iterations": 0,
        "tokens_served": 0,
        "queries_served": 0,
    }


def cell_of(makespans: dict[str, int], kv: dict[str, int]) -> Cell:
    runs = {
        key: build_run(
            key,
            max_batch=4,
            outcomes=[outcome("q", "s1", 1, 1)],
            wall_s=makespans[key] / 100,
            counters={"s1": counters(makespans[key], kv[key])},
        )
        for key in makespans
    }
    return Cell(2, 4, 1, runs)


def test_a_cell_reports_every_configuration_against_round_robin_static() -> None:
    keys = [c.key for c in CONFIGS]
    cell = cell_of(dict(zip(keys, (400, 200, 300, 100), strict=True)), dict.fromkeys(keys, 1000))
    row = cell.row()
    assert row["ratio_vs_rr_static"] == {
        "rr_iter": 2.0,
        "tok_static": pytest.approx(4 / 3, abs=1e-4),
        "mico": 4.0,
    }
    assert row["ratio_vs_rr_static_wall"] == row["ratio_vs_rr_static"]
    assert row["kv_cumulative_reduction"] == {"rr_iter": 0.0, "tok_static": 0.0, "mico": 0.0}
    imbalances, ratios = row["imbalance"], row["ratio_vs_rr_static"]
    assert isinstance(imbalances, dict)
    assert isinstance(ratios, dict)
    assert set(imbalances) == set(keys)
    assert BASELINE not in ratios


def test_overall_kv_reduction_weights_cells_by_their_kv_use() -> None:
    keys = [c.key for c in CONFIGS]
    small = cell_of(dict.fromkeys(keys, 10), {**dict.fromkeys(keys, 100), "mico": 50})
    large = cell_of(dict.fromkeys(keys, 10), {**dict.fromkeys(keys, 900), "mico": 900})
    assert overall_kv_reduction([small, large], "mico") == pytest.approx(50 / 1000)
