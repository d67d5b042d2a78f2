"""Table-driven tests of the policies built by name and of what a Decision records."""

from __future__ import annotations

import pytest

from gateway.routing.policy import POLICY_NAMES, build_policy
from gateway.settings import ROUTING_POLICIES
from tests.unit.routing.sites import Site, request

BASE = (
    ("serves_model", 3),
    ("healthy", 3),
    ("fits_context", 3),
    ("not_draining", 3),
    ("queue_bound", 3),
)
# Two requests in flight but little token load, versus one request with a long answer queued.
MANY_SHORT = Site("many_short", in_flight=2, outstanding_tokens=100, kv_capacity_tokens=4000)
ONE_LONG = Site("one_long", in_flight=1, outstanding_tokens=3000, kv_capacity_tokens=4000)
IDLE_FULL = Site("idle_full", in_flight=1, outstanding_tokens=3950, kv_capacity_tokens=4000)


def test_every_configurable_policy_can_be_built() -> None:
    assert set(ROUTING_POLICIES) == set(POLICY_NAMES)
    for name in ROUTING_POLICIES:
        assert build_policy(name).name == name


@pytest.mark.parametrize(
    ("policy", "chosen", "survivors"),
    [
        ("round_robin", "idle_full", BASE),  # first by name, load unseen
        ("least_requests", "idle_full", BASE),  # 1 request, no matter how long
        ("least_tokens", "many_short", BASE),
        ("mico", "many_short", (*BASE, ("kv_bound", 2))),  # idle_full cannot hold 60 tokens
    ],
)
def test_policies_choose_by_their_signal(policy, chosen, survivors) -> None:
    sites = [MANY_SHORT, ONE_LONG, IDLE_FULL]
    decision = build_policy(policy).route(request(prompt=10, max_tokens=50), sites)
    assert decision.site is not None
    assert (decision.site.name, decision.policy, decision.survivors) == (chosen, policy, survivors)


@pytest.mark.parametrize(
    ("policy", "scores"),
    [
        ("round_robin", {}),
        ("least_requests", {"many_short": 2.0, "one_long": 1.0, "idle_full": 1.0}),
        ("least_tokens", {"many_short": 130.0, "one_long": 3030.0, "idle_full": 3980.0}),
        ("mico", {"many_short": 130.0, "one_long": 3030.0, "idle_full": 3980.0}),
    ],
)
def test_decision_records_scores_and_predicted_tokens(policy, scores) -> None:
    sites = [MANY_SHORT, ONE_LONG, IDLE_FULL]
    decision = build_policy(policy).route(request(10, 50, predicted=20), sites)
    assert decision.scores == scores
    assert (decision.predicted_tokens, decision.planned_answer_tokens) == (20, 20)


def test_mico_scores_only_the_sites_where_the_request_fits() -> None:
    decision = build_policy("mico").route(request(10, 50), [MANY_SHORT, ONE_LONG, IDLE_FULL])
    assert decision.scores == {"many_short": 160.0, "one_long": 3060.0}


def test_decision_without_prediction_records_the_planned_max_tokens() -> None:
    decision = build_policy("least_tokens").route(request(10, 50), [MANY_SHORT])
    assert (decision.predicted_tokens, decision.planned_answer_tokens) == (None, 50)


def test_each_built_policy_keeps_its_own_turns() -> None:
    a, b = Site("a"), Site("b")
    first, second = build_policy("least_tokens"), build_policy("least_tokens")
    assert first.route(request(), [a, b]).site == a
    assert second.route(request(), [a, b]).site == a
