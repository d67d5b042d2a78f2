"""Adapter-aware routing: the residency view, the adapter_affinity scorer's order (device slot >
host memory > disk), the adapter term of completion_cost, and the built-in completion_cost
profile's choices: the site holding the adapter under equal load, placement on the least loaded
site when none holds it (and the rest of a burst following it), and yielding to load."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.routing.adapter_affinity import AdapterAffinity, RecordAdapter
from gateway.routing.adapter_residency import AdapterTier, SiteAdapters
from gateway.routing.completion_cost import (
    DEFAULT_ADAPTER_HOST_S,
    DEFAULT_ADAPTER_LOAD_S,
    CompletionCostModel,
)
from gateway.routing.policy import build_policy
from gateway.routing.types import SiteLatency, StepTime
from tests.unit.routing.sites import Site, request, resident

STEP = StepTime(0.01)


def idle(name: str, residency: SiteAdapters | None = None, **changes: object) -> Site:
    """An idle site serving adapters a and b, with a residency view of its own (routing
    writes to it)."""
    site = Site(
        name,
        latency=SiteLatency(step=STEP, batch_slots=8),
        adapters=frozenset({"a", "b"}),
        adapter_residency=residency or SiteAdapters(),
    )
    return replace(site, **changes)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_residency_tiers_from_reports_and_routing() -> None:
    clock = Clock()
    view = SiteAdapters(pending_s=5.0, clock=clock)
    view.apply(("a",), ("a", "b"), 0.0)
    assert (view.tier("a"), view.tier("b"), view.tier("c")) == (
        AdapterTier.DEVICE, AdapterTier.HOST, AdapterTier.DISK,
    )  # fmt: skip
    assert view.load_s is None
    view.routed("c")
    assert view.tier("c") is AdapterTier.DEVICE  # loading there now
    clock.now += 6.0
    view.apply(("a",), ("b",), 0.2)
    assert view.tier("c") is AdapterTier.DISK  # the report after the window did not show it
    assert view.load_s == 0.2
    view.apply((), (), 0.0)  # an unmeasured report keeps the last measurement
    assert view.load_s == 0.2
    assert view.tier("a") is AdapterTier.DISK


def test_residency_rejects_negative_window() -> None:
    with pytest.raises(ValueError, match="pending_s"):
        SiteAdapters(pending_s=-1.0)


def test_scorer_orders_device_over_host_over_disk() -> None:
    sites = [
        idle("disk"),
        idle("host", resident(host=("a",))),
        idle("device", resident(device=("a",))),
    ]
    assert AdapterAffinity().score(request(adapter="a"), sites).values == (0.0, 0.5, 1.0)
    # The base model's requests have no preference.
    assert AdapterAffinity().score(request(), sites).values == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="host_value"):
        AdapterAffinity(host_value=1.5)


def test_record_adapter_marks_the_chosen_site() -> None:
    site = idle("s")
    RecordAdapter().routed(request(adapter="b"), site)
    RecordAdapter().routed(request(), site)
    assert site.adapter_residency.tier("b") is AdapterTier.DEVICE


@pytest.mark.parametrize(
    ("residency", "adapter", "expected_s"),
    [
        (resident(), None, 0.0),
        (resident(device=("a",)), "a", 0.0),
        (resident(host=("a",)), "a", DEFAULT_ADAPTER_HOST_S),
        (resident(), "a", DEFAULT_ADAPTER_LOAD_S + DEFAULT_ADAPTER_HOST_S),
        # the site's measured read time wins over the default
        (resident(load_s=2.0), "a", 2.0 + DEFAULT_ADAPTER_HOST_S),
    ],
)
def test_completion_cost_charges_the_adapter_load(residency, adapter, expected_s) -> None:
    site = idle("s", residency)
    model = CompletionCostModel(prefill_tokens_per_s=1000.0)
    base = model.estimate(request(500, 10), site).completion_s
    estimate = model.estimate(request(500, 10, adapter=adapter), site)
    assert estimate.adapter_s == pytest.approx(expected_s)
    assert estimate.completion_s == pytest.approx(base + expected_s)


def _route(sites: list[Site], adapter: str) -> str:
    decision = build_policy("completion_cost").route(request(100, 10, adapter=adapter), sites)
    assert decision.site is not None
    return decision.site.name


def test_equal_load_goes_where_the_adapter_is() -> None:
    for order in ((0, 1), (1, 0)):
        sites = [
            idle("cold"),
            idle("warm", resident(device=("a",))),
        ]
        assert _route([sites[i] for i in order], "a") == "warm"
    host_vs_disk = [
        idle("disk"),
        idle("host", resident(host=("a",))),
    ]
    assert _route(host_vs_disk, "a") == "host"


def test_placement_on_the_least_loaded_site_and_the_burst_follows() -> None:
    policy = build_policy("completion_cost")
    busy, free = idle("busy", queued_tokens=4000), idle("free")
    first = policy.route(request(100, 10, adapter="a"), [busy, free])
    assert first.site is not None
    assert first.site.name == "free"
    # Equal load now (the reports lag): the next request of the adapter follows the first.
    even = replace(busy, queued_tokens=0)
    for _ in range(3):
        decision = policy.route(request(100, 10, adapter="a"), [even, free])
        assert decision.site is not None
        assert decision.site.name == "free"


def test_affinity_yields_to_a_much_more_loaded_site() -> None:
    # The warm site has 3 s of prompts queued: far more than loading the adapter elsewhere.
    warm = idle("warm", resident(device=("a",)), queued_tokens=60_000)
    assert _route([warm, idle("cold")], "a") == "cold"
    # A little more load does not move it (loading costs 0.5 s; the slots would churn).
    slightly = replace(warm, queued_tokens=2_000)
    assert _route([slightly, idle("cold")], "a") == "warm"
