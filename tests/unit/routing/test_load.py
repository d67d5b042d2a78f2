"""Table-driven tests of the shared load arithmetic and the request's planned token counts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.routing.filters import KvBoundFilter
from gateway.routing.load import fits, free_kv_tokens, is_tie, normalized
from tests.unit.routing.sites import Site, request


@pytest.mark.parametrize(
    ("req", "answer", "total"),
    [
        (request(prompt=10, max_tokens=50), 50, 60),  # no prediction: plan with max_tokens
        (request(prompt=10, max_tokens=50, predicted=20), 20, 30),
        (request(prompt=10, max_tokens=50, predicted=80), 50, 60),  # the site stops at max
        (request(prompt=0, max_tokens=1, predicted=0), 0, 0),
        # GATEWAY_PLAN_WITHOUT_PREDICTION=prompt_only: no prediction plans no answer at all.
        (replace(request(prompt=10, max_tokens=50), unpredicted="prompt_only"), 0, 10),
        (
            replace(request(prompt=10, max_tokens=50, predicted=80), unpredicted="prompt_only"),
            50,
            60,
        ),
    ],
)
def test_planned_tokens(req, answer, total) -> None:
    assert (req.answer_tokens, req.total_tokens) == (answer, total)


@pytest.mark.parametrize(
    ("site", "free"),
    [
        (Site("a", kv_capacity_tokens=None, outstanding_tokens=500), None),
        (Site("a", kv_capacity_tokens=1000, outstanding_tokens=300), 700),
        (Site("a", kv_capacity_tokens=1000, outstanding_tokens=1000), 0),
        (Site("a", kv_capacity_tokens=1000, outstanding_tokens=1500), 0),  # queued past KV
    ],
)
def test_free_kv_tokens(site, free) -> None:
    assert free_kv_tokens(site) == free


@pytest.mark.parametrize(
    ("need", "free", "ok"),
    [(10, None, True), (10, 10, True), (11, 10, False), (0, 0, True)],
)
def test_fits(need, free, ok) -> None:
    assert fits(need, free) is ok


@pytest.mark.parametrize(
    ("a", "b", "tie"),
    [(1.0, 1.0, True), (0.1 + 0.2, 0.3, True), (1.0, 1.001, False), (0.0, 1e-12, True)],
)
def test_is_tie(a, b, tie) -> None:
    assert is_tie(a, b) is tie


@pytest.mark.parametrize("weight", [0.0, -1.0])
def test_normalized_refuses_a_weight_that_is_not_positive(weight) -> None:
    with pytest.raises(ValueError, match="capacity weight"):
        normalized(10, weight)


BIG = Site("big", kv_capacity_tokens=1000, outstanding_tokens=0)
HALF = Site("half", kv_capacity_tokens=1000, outstanding_tokens=500)
FULL = Site("full", kv_capacity_tokens=1000, outstanding_tokens=1200)
NEW = Site("new", kv_capacity_tokens=None, outstanding_tokens=5000)


@pytest.mark.parametrize(
    ("req", "sites", "kept"),
    [
        (request(prompt=100, max_tokens=400), [BIG, HALF, FULL], [BIG, HALF]),  # 500 fits 500
        (request(prompt=100, max_tokens=401), [BIG, HALF, FULL], [BIG]),
        (request(prompt=100, max_tokens=900, predicted=300), [HALF, BIG], [HALF, BIG]),
        (request(prompt=100, max_tokens=2000), [BIG, HALF], []),
        (request(prompt=100, max_tokens=2000), [FULL, NEW], [NEW]),  # unknown is kept
        # Nothing holds 700 now, but both could once free: both are kept (the request queues).
        (request(prompt=100, max_tokens=600), [HALF, FULL], [HALF, FULL]),
        (request(prompt=0, max_tokens=1, predicted=0), [FULL], [FULL]),  # nothing to hold
        (request(), [], []),
    ],
)
def test_kv_bound_filter(req, sites, kept) -> None:
    assert KvBoundFilter()(req, sites) == kept
