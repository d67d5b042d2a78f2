"""The batch API's assignment by the cost model (gateway/routing/batch_cost.py, and
plan_batch_by_cost): the same cost as online routing, with what the batch itself already put on
each site."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gateway.batches.plan import PlanItem, plan_batch_by_cost
from gateway.routing.batch_cost import CostQuery, cost_assign
from gateway.routing.completion_cost import CompletionCostModel
from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.routing.types import RoutingRequest, SiteLatency, StepTime
from tests.unit.routing.sites import Site

MODEL = CompletionCostModel(prefill_tokens_per_s=1000.0)
STEP = SiteLatency(step=StepTime(0.01), batch_slots=8)


def q(qid: str, prompt: int, answer: int = 10, tokens: tuple[int, ...] = ()) -> CostQuery:
    request = RoutingRequest("m", prompt, answer, answer, 1, prompt_token_ids=tokens)
    return CostQuery(qid, request, bucket=1)


def sites(*rates: float | None) -> list[Site]:
    return [
        Site(f"s{i}", latency=STEP, prefill_tokens_per_s=rate, prefix=SitePrefix(1000))
        for i, rate in enumerate(rates)
    ]


def test_equal_items_spread_over_equal_sites() -> None:
    placed = cost_assign([q(str(i), 500) for i in range(6)], sites(None, None, None), MODEL)
    assert Counter(a.site for a in placed) == {"s0": 2, "s1": 2, "s2": 2}


def test_a_faster_site_takes_more() -> None:
    placed = cost_assign([q(str(i), 1000) for i in range(8)], sites(1000.0, 3000.0), MODEL)
    counts = Counter(a.site for a in placed)
    assert counts["s1"] > counts["s0"] >= 1


def test_the_batch_counts_what_its_earlier_items_put_in_each_cache() -> None:
    shared = tuple(range(1, 1025))  # 1,024 tokens every item starts with
    queries = [q(str(i), 1100, tokens=(*shared, *range(5000 + 100 * i, 5076 + 100 * i)))
               for i in range(6)]  # fmt: skip
    placed = cost_assign(queries, sites(None, None), MODEL)
    # The first two go one to each site (waiting 1.1 s behind the other's prefill would cost
    # more than the 1 s the shared prefix saves); the others find it cached on either.
    assert {placed[0].site, placed[1].site} == {"s0", "s1"}
    assert "0 of 1100 prompt tokens cached" in placed[1].why
    assert all("1024 of 1100 prompt tokens cached" in a.why for a in placed[2:])
    assert Counter(a.site for a in placed) == {"s0": 3, "s1": 3}


def test_no_site() -> None:
    assert [a.site for a in cost_assign([q("1", 10)], [], MODEL)] == [None]


@dataclass(frozen=True)
class IdSite(Site):
    site_id: int = 0


def test_the_batch_plan_uses_healthy_sites_of_the_model() -> None:
    federation = [
        IdSite("a", latency=STEP, site_id=1),
        IdSite("down", latency=STEP, healthy=False, site_id=2),
        IdSite("other", latency=STEP, model="x", site_id=3),
    ]
    items = [PlanItem(i, 100, 10, 10, 1) for i in range(3)]
    placements = plan_batch_by_cost("m", items, federation, MODEL)
    assert [p.site_id for p in placements] == [1, 1, 1]
    assert placements[0].reason.startswith("cost batch: bucket 1: least estimated completion")
    unplaced = plan_batch_by_cost("x2", items, federation, MODEL)
    assert {p.site_id for p in unplaced} == {None}
