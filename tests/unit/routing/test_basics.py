"""The original routing cases (moved from tests/unit/test_routing.py, every case kept): the base
filters, round robin and the policy's explanation of an empty answer."""

from __future__ import annotations

import pytest

from gateway.routing.filters import (
    FitsContextFilter,
    HealthyFilter,
    NotDrainingFilter,
    QueueBoundFilter,
    ServesModelFilter,
)
from gateway.routing.pickers import RoundRobinPicker
from gateway.routing.policy import build_policy
from tests.unit.routing.sites import Site, request

A, B, C = Site("a"), Site("b"), Site("c")
DOWN = Site("down", healthy=False)
OTHER = Site("other", model="x")
SHORT = Site("short", max_model_len=64)
UNKNOWN = Site("unknown", max_model_len=None)
DRAINING = Site("draining", draining=True)
QUEUE_3 = Site("queue_3", queued_requests=3, queued_tokens=300)


@pytest.mark.parametrize(
    ("site_filter", "req", "sites", "kept"),
    [
        (HealthyFilter(), request(), [A, DOWN, B], [A, B]),
        (HealthyFilter(), request(), [DOWN], []),
        (HealthyFilter(), request(), [], []),
        (ServesModelFilter(), request(), [A, OTHER, B], [A, B]),
        (ServesModelFilter(), request(model="x"), [A, OTHER], [OTHER]),
        (FitsContextFilter(), request(32, 32), [SHORT, A], [SHORT, A]),
        (FitsContextFilter(), request(32, 33), [SHORT, A], [A]),
        (FitsContextFilter(), request(1000, 1000), [A, UNKNOWN], [UNKNOWN]),
        (FitsContextFilter(), request(), [B, A], [B, A]),  # order is kept
        (NotDrainingFilter(), request(), [A, DRAINING, B], [A, B]),
        (NotDrainingFilter(), request(), [DRAINING], []),
        (QueueBoundFilter(), request(), [A, QUEUE_3], [A, QUEUE_3]),  # unbounded
        (QueueBoundFilter(max_requests=4), request(), [QUEUE_3, A], [QUEUE_3, A]),
        (QueueBoundFilter(max_requests=3), request(), [QUEUE_3, A], [A]),  # at the bound: out
        (QueueBoundFilter(max_tokens=301), request(), [QUEUE_3], [QUEUE_3]),
        (QueueBoundFilter(max_tokens=300), request(), [QUEUE_3, B], [B]),
        (QueueBoundFilter(max_requests=10, max_tokens=300), request(), [QUEUE_3], []),
    ],
)
def test_filters(site_filter, req, sites, kept) -> None:
    assert site_filter(req, sites) == kept


@pytest.mark.parametrize(
    ("rounds", "candidates", "expected"),
    [
        (4, [A, B, C], [A, B, C, A]),
        (3, [C, A, B], [A, B, C]),  # by name, not by input order
        (2, [A], [A, A]),
        (1, [], [None]),
    ],
)
def test_round_robin_cycles_by_name(rounds, candidates, expected) -> None:
    picker = RoundRobinPicker()
    totals = [0.0] * len(candidates)
    assert [picker.pick(request(), candidates, totals) for _ in range(rounds)] == expected


def test_round_robin_keeps_separate_turns_per_model() -> None:
    picker, totals = RoundRobinPicker(), [0.0, 0.0]
    assert picker.pick(request(model="m"), [A, B], totals) == A
    assert picker.pick(request(model="x"), [A, B], totals) == A
    assert picker.pick(request(model="m"), [A, B], totals) == B


def test_round_robin_decision_carries_no_scores() -> None:
    assert build_policy("round_robin").route(request(), [A, B]).scores == {}


def test_policy_explains_an_empty_answer() -> None:
    decision = build_policy("round_robin").route(request(2000, 10), [A, DOWN, OTHER])
    assert decision.site is None
    assert decision.survivors == (
        ("serves_model", 2),
        ("healthy", 1),
        ("fits_context", 0),
        ("not_draining", 0),
        ("queue_bound", 0),
    )


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        build_policy("fastest")
