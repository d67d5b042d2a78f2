"""Table-driven tests of MICO's online form (one query at a time): the `mico` profile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.routing.policy import build_policy
from tests.unit.routing.sites import Site, request

A, B = Site("a"), Site("b")
SMALL = Site("small", outstanding_tokens=100, capacity_weight=1.0)
BIG = Site("big", outstanding_tokens=150, capacity_weight=2.0)
ALMOST_FULL = Site("almost_full", outstanding_tokens=90, kv_capacity_tokens=100)
BUSY = Site("busy", outstanding_tokens=500)
NEW = Site("new", outstanding_tokens=900, kv_capacity_tokens=None)


@pytest.mark.parametrize(
    ("sites", "chosen", "scores"),
    [
        # (100+20)/1 = 120 against (150+20)/2 = 85.
        ([SMALL, BIG], "big", {"small": 120.0, "big": 85.0}),
        # almost_full is lightest but has 10 tokens of free KV for a 20-token query.
        ([ALMOST_FULL, BUSY], "busy", {"busy": 520.0}),
        ([ALMOST_FULL, NEW], "new", {"new": 920.0}),  # unknown KV holds anything
        # Nothing holds it now: it waits in the queue of the least loaded candidate.
        ([ALMOST_FULL], "almost_full", {"almost_full": 110.0}),
        (
            [ALMOST_FULL, replace(BUSY, kv_capacity_tokens=100)],
            "almost_full",
            {"almost_full": 110.0, "busy": 520.0},
        ),
        ([], None, {}),
    ],
)
def test_online_pick(sites, chosen, scores) -> None:
    pick = build_policy("mico").route(request(prompt=10, max_tokens=10), sites)
    assert (pick.site.name if pick.site else None, pick.scores) == (chosen, scores)


@pytest.mark.parametrize(
    ("buckets", "expected"),
    [
        ([1, 1, 1], ["a", "b", "a"]),
        ([1, 1, 2, 1, 2], ["a", "b", "a", "a", "b"]),  # one turn counter per bucket
        ([None, 1, None], ["a", "a", "b"]),  # no bucket is a bucket of its own
    ],
)
def test_equal_sites_alternate_within_a_bucket(buckets, expected) -> None:
    policy = build_policy("mico")
    picks = [policy.route(request(bucket=bucket), [B, A]).site for bucket in buckets]
    assert [site.name if site else None for site in picks] == expected


def test_online_form_keeps_equal_sites_within_one_query() -> None:
    policy, sites = build_policy("mico"), [Site("a"), Site("b"), Site("c")]
    for _ in range(50):
        req = request(prompt=30, max_tokens=70, bucket=3)
        chosen = policy.route(req, sites).site
        assert chosen is not None
        sites = [
            replace(s, outstanding_tokens=s.outstanding_tokens + 100) if s == chosen else s
            for s in sites
        ]
        loads = [s.outstanding_tokens for s in sites]
        assert max(loads) - min(loads) <= 100
