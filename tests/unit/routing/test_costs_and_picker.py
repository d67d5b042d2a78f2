"""Table-driven tests of the load costs, the normalization that turns a cost into a score, and
the highest-score picker."""

from __future__ import annotations

import pytest

from gateway.routing.costs import RequestCountCost, TokenLoadCost
from gateway.routing.pickers import MaxScorePicker, RoundRobinPicker
from gateway.routing.scorers import LowestCost, normalize_costs
from tests.unit.routing.sites import Site, lowest, request


@pytest.mark.parametrize(
    ("site", "cost"),
    [
        (Site("a", in_flight=0), 0.0),
        (Site("a", in_flight=3), 3.0),
        (Site("a", in_flight=3, capacity_weight=2.0), 1.5),
        (Site("a", in_flight=3, outstanding_tokens=10_000), 3.0),  # tokens do not count
    ],
)
def test_request_count_cost(site, cost) -> None:
    assert RequestCountCost().cost(request(), site) == cost


@pytest.mark.parametrize(
    ("req", "site", "cost"),
    [
        (request(prompt=10, max_tokens=50, predicted=20), Site("a", outstanding_tokens=100), 130),
        (request(prompt=10, max_tokens=50), Site("a", outstanding_tokens=100), 160),
        (request(prompt=10, max_tokens=50, predicted=90), Site("a"), 60),  # capped at max
        (
            request(prompt=10, max_tokens=50, predicted=20),
            Site("a", outstanding_tokens=100, capacity_weight=2.0),
            65,
        ),
        (request(prompt=10, max_tokens=50), Site("a", in_flight=9), 60),  # count does not
    ],
)
def test_token_load_cost(req, site, cost) -> None:
    assert TokenLoadCost().cost(req, site) == cost


@pytest.mark.parametrize(
    ("costs", "how", "values"),
    [
        ([], "range", ()),
        ([5.0], "range", (1.0,)),
        ([2.0, 2.0], "range", (1.0, 1.0)),
        ([1.0, 3.0, 2.0], "range", (1.0, 0.0, 0.5)),
        ([0.0, 10.0], "range", (1.0, 0.0)),
        ([100.0, 100.0 * (1 + 1e-12), 300.0], "range", (1.0, 1.0, 0.0)),  # rounding is a tie
        ([1.0, 2.0, 4.0], "ratio", (1.0, 0.5, 0.25)),
        ([0.5, 0.5], "ratio", (1.0, 1.0)),
        ([0.0, 2.0], "ratio", (1.0, 0.0)),  # a free site: every other scores nothing
    ],
)
def test_normalize_costs(costs, how, values) -> None:
    assert normalize_costs(costs, how) == pytest.approx(values)


def test_lowest_cost_scores_in_unit_range_and_keeps_the_costs() -> None:
    sites = [Site("a", in_flight=1), Site("b", in_flight=5), Site("c", in_flight=3)]
    scored = LowestCost(RequestCountCost()).score(request(), sites)
    assert scored.values == (1.0, 0.0, 0.5)
    assert scored.costs == (1.0, 5.0, 3.0)


A0 = Site("a", outstanding_tokens=0)
B0 = Site("b", outstanding_tokens=0)
C0 = Site("c", outstanding_tokens=0)
A_BUSY = Site("a", outstanding_tokens=500)
SMALL = Site("small", outstanding_tokens=100, capacity_weight=1.0)
LARGE = Site("large", outstanding_tokens=150, capacity_weight=2.0)


@pytest.mark.parametrize(
    ("sites", "rounds", "expected"),
    [
        ([A_BUSY, B0], 3, ["b", "b", "b"]),
        ([B0, A0], 4, ["a", "b", "a", "b"]),  # ties take turns in name order
        ([A0, B0, C0], 4, ["a", "b", "c", "a"]),
        ([A_BUSY, B0, C0], 3, ["b", "c", "b"]),  # only the tied best take turns
        # (100+20)/1 = 120 vs (150+20)/2 = 85: the bigger site wins although it holds more.
        ([SMALL, LARGE], 2, ["large", "large"]),
        ([], 2, [None, None]),
    ],
)
def test_lowest_cost_profile(sites, rounds, expected) -> None:
    profile = lowest(TokenLoadCost())
    picks = [profile.route(request(prompt=10, max_tokens=10), sites).site for _ in range(rounds)]
    assert [site.name if site else None for site in picks] == expected


def test_a_one_cost_decision_records_every_candidates_cost() -> None:
    decision = lowest(TokenLoadCost()).route(request(10, 10), [SMALL, LARGE, A_BUSY])
    assert decision.site == LARGE
    assert decision.scores == {"small": 120.0, "large": 85.0, "a": 520.0}


@pytest.mark.parametrize(
    ("totals", "rounds", "expected"),
    [
        ([0.2, 0.9, 0.5], 2, ["b", "b"]),
        ([0.7, 0.7, 0.1], 3, ["a", "b", "a"]),
        ([0.7, 0.7 + 1e-12, 0.7], 3, ["a", "b", "c"]),  # rounding is a tie
    ],
)
def test_max_score_picker(totals, rounds, expected) -> None:
    picker, sites = MaxScorePicker(), [Site("a"), Site("b"), Site("c")]
    picks = [picker.pick(request(), sites, totals) for _ in range(rounds)]
    assert [site.name if site else None for site in picks] == expected


def test_max_score_picker_keeps_separate_turns_per_model() -> None:
    picker, sites = MaxScorePicker(), [A0, B0]
    assert picker.pick(request(model="m"), sites, [1.0, 1.0]) == A0
    assert picker.pick(request(model="x"), sites, [1.0, 1.0]) == A0
    assert picker.pick(request(model="m"), sites, [1.0, 1.0]) == B0


def test_round_robin_reads_no_score() -> None:
    picker, sites = RoundRobinPicker(), [Site("a"), Site("b")]
    assert [picker.pick(request(), sites, [0.0, 1.0]) for _ in range(2)] == sites
