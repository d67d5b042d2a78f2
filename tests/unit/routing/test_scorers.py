"""Table-driven tests of the scorers and of the lowest-score picker."""

from __future__ import annotations

import pytest

from gateway.routing.pickers import MinScorePicker
from gateway.routing.scorers import LeastRequestsScorer, LeastTokensScorer
from tests.unit.routing.sites import Site, request


@pytest.mark.parametrize(
    ("site", "score"),
    [
        (Site("a", in_flight=0), 0.0),
        (Site("a", in_flight=3), 3.0),
        (Site("a", in_flight=3, capacity_weight=2.0), 1.5),
        (Site("a", in_flight=3, outstanding_tokens=10_000), 3.0),  # tokens do not count
    ],
)
def test_least_requests_scorer(site, score) -> None:
    assert LeastRequestsScorer().score(request(), site) == score


@pytest.mark.parametrize(
    ("req", "site", "score"),
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
def test_least_tokens_scorer(req, site, score) -> None:
    assert LeastTokensScorer().score(req, site) == score


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
        ([A_BUSY, B0, C0], 3, ["b", "c", "b"]),  # only the tied lowest take turns
        # (100+20)/1 = 120 vs (150+20)/2 = 85: the bigger site wins although it holds more.
        ([SMALL, LARGE], 2, ["large", "large"]),
        ([], 2, [None, None]),
    ],
)
def test_min_score_picker(sites, rounds, expected) -> None:
    picker = MinScorePicker(LeastTokensScorer())
    picks = [picker.pick(request(prompt=10, max_tokens=10), sites) for _ in range(rounds)]
    assert [site.name if site else None for site in picks] == expected


def test_min_score_picker_returns_every_candidates_score() -> None:
    pick = MinScorePicker(LeastTokensScorer()).choose(request(10, 10), [SMALL, LARGE, A_BUSY])
    assert pick.site == LARGE
    assert pick.scores == {"small": 120.0, "large": 85.0, "a": 520.0}


def test_min_score_picker_keeps_separate_turns_per_model() -> None:
    picker = MinScorePicker(LeastRequestsScorer())
    assert picker.pick(request(model="m"), [A0, B0]) == A0
    assert picker.pick(request(model="x"), [A0, B0]) == A0
    assert picker.pick(request(model="m"), [A0, B0]) == B0


def test_min_score_picker_is_named_after_its_scorer() -> None:
    assert MinScorePicker(LeastRequestsScorer()).name == "least_requests"
