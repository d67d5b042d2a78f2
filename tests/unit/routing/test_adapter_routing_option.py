"""GATEWAY_ADAPTER_ROUTING: `affinity` (the adapter's load charged in completion_cost and the
adapter_affinity scorer) against `blind` (every site that serves the adapter alike), the two arms
of fedsim/adapter_study.py; and the study's verdict rule (fedsim/adapter_report.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedsim.adapter_report import AFFINITY, BLIND, verdict
from gateway.routing.adapter_affinity import RecordAdapter
from gateway.routing.adapter_residency import AdapterTier
from gateway.routing.completion_cost import CompletionCostModel
from gateway.routing.policy import build_policy
from gateway.settings import RoutingSettings, SettingsError
from tests.unit.routing.sites import request, resident
from tests.unit.routing.test_adapter_affinity import idle


def _route(adapter_routing: str, warm_queued_tokens: int) -> str:
    """Where completion_cost sends a request of adapter a: `warm` holds a in a slot and has
    `warm_queued_tokens` of prompts queued, `cold` must read a from disk and is idle."""
    policy = build_policy("completion_cost", adapter_routing=adapter_routing)  # type: ignore[arg-type]
    warm = idle("warm", resident(device=("a",)), queued_tokens=warm_queued_tokens)
    decision = policy.route(request(100, 10, adapter="a"), [warm, idle("cold")])
    assert decision.site is not None
    return decision.site.name


def test_affinity_keeps_the_adapter_where_it_is_blind_does_not() -> None:
    # 2,000 queued tokens (0.1 s at 20k tokens/s) against a 0.5 s read from disk elsewhere.
    assert _route("affinity", 2_000) == "warm"
    assert _route("blind", 2_000) == "cold"
    # Base-model requests: both options route alike.
    for option in ("affinity", "blind"):
        policy = build_policy("completion_cost", adapter_routing=option)
        warm = idle("warm", resident(device=("a",)), queued_tokens=2_000)
        decision = policy.route(request(100, 10), [warm, idle("cold")])
        assert decision.site is not None
        assert decision.site.name == "cold"


def test_blind_has_no_adapter_term_scorer_or_record() -> None:
    site = idle("s", resident())
    blind = CompletionCostModel(prefill_tokens_per_s=1000.0, adapter_blind=True)
    assert blind.estimate(request(500, 10, adapter="a"), site).adapter_s == 0.0
    aware = replace(blind, adapter_blind=False)
    assert aware.estimate(request(500, 10, adapter="a"), site).adapter_s > 0.1
    policy = build_policy("completion_cost", adapter_routing="blind")
    assert "adapter_affinity" not in [w.scorer.name for w in policy.scorers]
    assert not any(isinstance(o, RecordAdapter) for o in policy.observers)
    aware_policy = build_policy("completion_cost")
    assert "adapter_affinity" in [w.scorer.name for w in aware_policy.scorers]
    assert any(isinstance(o, RecordAdapter) for o in aware_policy.observers)
    # Routed by the blind profile: the site's view does not record the adapter as loading.
    policy.route(request(100, 10, adapter="b"), [site])
    assert site.adapter_residency.tier("b") is AdapterTier.DISK


def test_setting_default_and_validation() -> None:
    assert RoutingSettings().adapter_routing == "affinity"  # the study's verdict (docs/routing.md)
    with pytest.raises(SettingsError, match="GATEWAY_ADAPTER_ROUTING"):
        RoutingSettings(adapter_routing="sticky")  # type: ignore[arg-type]


def _points(arm: str, goodput: list[float], p99: list[float]) -> list[dict[str, object]]:
    return [
        {"arm": arm, "load": 0.9, "seed": s, "goodput_rps": g, "ttft_p99_s": t}
        for s, (g, t) in enumerate(zip(goodput, p99, strict=True))
    ]


def test_verdict_needs_a_win_beyond_the_seed_spread() -> None:
    beats = _points(AFFINITY.name, [100, 105, 110], [1, 1, 1]) + _points(
        BLIND.name, [80, 90, 95], [1, 1, 1]
    )
    assert verdict(beats) == {
        "per_load": {"0.9": {"affinity_better": True, "affinity_worse": False}},
        "winner": "affinity",
        "decided": True,
    }
    overlap = _points(AFFINITY.name, [90, 105, 110], [1, 1, 1]) + _points(
        BLIND.name, [80, 90, 95], [1, 1, 1]
    )
    assert verdict(overlap)["decided"] is False
    loses = _points(AFFINITY.name, [90, 91, 92], [3, 4, 5]) + _points(
        BLIND.name, [90, 91, 92], [1, 1.5, 2]
    )
    assert verdict(loses)["winner"] == "blind"
