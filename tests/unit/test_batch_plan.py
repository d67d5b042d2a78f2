"""The batch runner's decisions: MICO placement of a batch's items over the healthy sites of its
model, and the bookkeeping rules (settled status, retries, backoff)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import pytest

from gateway.batch_settings import BATCH_ORDERS, BatchOrder, BatchSettings
from gateway.batches.plan import (
    Placement,
    PlanItem,
    make_plan,
    plan_batch,
    retry_delay_s,
)
from gateway.batches.records import settled_status
from gateway.db.models import BatchStatus
from gateway.errors import (
    Conflict,
    GatewayError,
    InternalFailure,
    InvalidRequest,
    NotFound,
    Overloaded,
    RateLimited,
    TimedOut,
    Unavailable,
    UpstreamFailed,
)


@dataclass(frozen=True)
class Site:
    name: str
    site_id: int
    model: str = "m"
    healthy: bool = True
    capacity_weight: float = 1.0
    outstanding_tokens: int = 0


def items(*specs: tuple[int, int, int | None, int | None]) -> list[PlanItem]:
    """(prompt, max_tokens, predicted, bucket) per item, indexed from 0."""
    return [PlanItem(i, *spec) for i, spec in enumerate(specs)]


def site_tokens(plan: list[PlanItem], sites: list[Site]) -> dict[int | None, int]:
    placements = plan_batch("m", plan, sites)
    tokens: dict[int | None, int] = defaultdict(int)
    for item, placement in zip(plan, placements, strict=True):
        tokens[placement.site_id] += item.prompt_tokens + item.planned_tokens
    return dict(tokens)


def test_only_healthy_sites_of_the_model_take_items() -> None:
    sites = [
        Site("a", 1),
        Site("down", 2, healthy=False),
        Site("other", 3, model="x"),
        Site("b", 4),
    ]
    plan = items(*[(10, 20, 10, 1)] * 6)
    placements = plan_batch("m", plan, sites)
    assert [p.index for p in placements] == list(range(6))
    assert {p.site_id for p in placements} == {1, 4}
    assert all(p.reason.startswith("mico batch: bucket 1") for p in placements)


@pytest.mark.parametrize(
    ("sites", "plan", "expected"),
    [
        # Equal sites, equal items: half each.
        ([Site("a", 1), Site("b", 2)], items(*[(10, 50, 30, 2)] * 4), {1: 80, 2: 80}),
        # Capacity 2:1: the big site carries twice the tokens.
        (
            [Site("small", 1), Site("big", 2, capacity_weight=2.0)],
            items(*[(10, 50, 40, 3)] * 6),
            {1: 100, 2: 200},
        ),
        # A site already carrying 200 tokens gets only what evens the loads out (250 each).
        (
            [Site("busy", 1, outstanding_tokens=200), Site("idle", 2)],
            items(*[(25, 100, 25, 1)] * 6),
            {1: 50, 2: 250},
        ),
        # Without predictions, items plan with max_tokens (one length group).
        (
            [Site("a", 1), Site("b", 2)],
            items((5, 95, None, None), (5, 45, None, None), (5, 45, None, None)),
            {1: 100, 2: 100},
        ),
    ],
    ids=["equal", "capacity 2:1", "busy site", "no predictions"],
)
def test_token_load_is_balanced(sites, plan, expected) -> None:
    assert site_tokens(plan, sites) == expected


def test_a_batch_larger_than_any_kv_cache_is_placed_whole() -> None:
    # The batch is dispatched a few items at a time, so its total may exceed every site's KV.
    plan = items(*[(100, 500, 400, i % 10) for i in range(3000)])
    tokens = site_tokens(plan, [Site("a", 1), Site("b", 2), Site("c", 3)])
    assert None not in tokens
    assert sum(tokens.values()) == 3000 * 500
    assert max(tokens.values()) - min(tokens.values()) <= 500


def test_no_healthy_site_leaves_items_for_the_policy() -> None:
    placements = plan_batch("m", items((1, 2, None, None)), [Site("a", 1, healthy=False)])
    assert placements[0].site_id is None
    assert "no healthy site served model 'm'" in placements[0].reason


@pytest.mark.parametrize(
    ("counts", "cancel_requested", "expired", "expected"),
    [
        ((3, 1, 1, 0), False, False, None),
        ((3, 2, 1, 0), False, False, BatchStatus.COMPLETED),
        ((3, 0, 3, 0), False, False, BatchStatus.FAILED),
        ((3, 1, 0, 1), True, False, None),
        ((3, 1, 0, 2), True, False, BatchStatus.CANCELLED),
        ((3, 3, 0, 0), True, False, BatchStatus.CANCELLED),
        ((3, 1, 0, 1), False, True, None),
        ((3, 1, 0, 2), False, True, BatchStatus.EXPIRED),
        ((3, 3, 0, 0), False, True, BatchStatus.EXPIRED),
        ((3, 1, 0, 2), True, True, BatchStatus.CANCELLED),
    ],
)
def test_settled_status(counts, cancel_requested, expired, expected) -> None:
    total, completed, failed, cancelled = counts
    status = settled_status(
        total=total,
        completed=completed,
        failed=failed,
        cancelled=cancelled,
        cancel_requested=cancel_requested,
        expired=expired,
    )
    assert status == expected


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (InvalidRequest("bad"), False),
        (NotFound("gone"), False),
        (Conflict("busy"), False),
        (RateLimited("later", limit="tokens"), True),
        (Overloaded("full"), True),
        (InternalFailure("oops"), True),
        (UpstreamFailed("site broke"), True),
        (Unavailable("no site"), True),
        (TimedOut("slow"), True),
    ],
)
def test_retryable(error: GatewayError, expected: bool) -> None:
    """Server-side failures (no site now, a site failed) and rate limits are tried again; the
    client's own errors are final at once."""
    assert error.retryable is expected


@pytest.mark.parametrize(
    ("attempts", "delay"),
    [(0, 1.0), (1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (40, 30.0)],
)
def test_retry_delay(attempts: int, delay: float) -> None:
    assert retry_delay_s(attempts) == delay


def planned(order: BatchOrder, plan: list[PlanItem], sites: list[Site]) -> list[Placement]:
    return make_plan("m", plan, sites, BatchSettings(order=order))


def in_rank_order(placements: list[Placement]) -> list[int]:
    return [p.index for p in sorted(placements, key=lambda p: p.rank)]


def test_each_order_ranks_every_item_once() -> None:
    # (prompt, max_tokens, predicted, bucket)
    plan = items((10, 50, 5, 1), (10, 50, 40, 2), (10, 52, None, None), (10, 50, 40, 2))
    sites = [Site("a", 1)]
    longest = planned("longest_first", plan, sites)
    # Planned: the prediction, else max_tokens: 5, 40, 52, 40.
    assert in_rank_order(longest) == [2, 1, 3, 0]
    assert in_rank_order(planned("submission", plan, sites)) == [0, 1, 2, 3]
    for order in BATCH_ORDERS:
        placements = planned(order, plan, sites)
        assert [p.index for p in placements] == [0, 1, 2, 3]
        assert sorted(p.rank for p in placements) == [0, 1, 2, 3]
        assert {p.site_id for p in placements} == {1}


def test_without_a_prediction_prompt_only_plans_nothing_so_those_go_last() -> None:
    plan = [
        PlanItem(0, 10, 50, 5, 1),
        PlanItem(1, 10, 90, None, None, "prompt_only"),
        PlanItem(2, 10, 50, 40, 2),
    ]
    assert in_rank_order(planned("longest_first", plan, [Site("a", 1)])) == [2, 0, 1]


def blocks(*path: int) -> tuple[int, ...]:
    """Chained ids as the gateway makes them: each names its block and all before it."""
    return tuple(hash(path[: i + 1]) for i in range(len(path)))


def test_dfs_keeps_each_prefix_together() -> None:
    paths = [(1, 2), (3, 4), (1, 5), (3, 4, 6), (1, 2, 7)]
    plan = [PlanItem(i, 48, 8, 8, 1, block_ids=blocks(*p)) for i, p in enumerate(paths)]
    order = in_rank_order(planned("dfs", plan, [Site("a", 1)]))
    heads = [paths[i][0] for i in order]
    assert heads in ([1, 1, 1, 3, 3], [3, 3, 1, 1, 1])


def test_blend_gives_each_site_a_range_weighted_by_capacity() -> None:
    # Dense (long prompt, short answer) and sparse (short prompt, long answer) alternating.
    plan = [
        PlanItem(i, 2000 if i % 2 else 40, 2000, 4 if i % 2 else 1500, 1, block_ids=blocks(i))
        for i in range(60)
    ]
    sites = [Site("small", 1), Site("big", 2, capacity_weight=3.0), Site("down", 3, healthy=False)]
    placements = planned("blend", plan, sites)
    assert sorted(p.rank for p in placements) == list(range(60))
    by_site = defaultdict(list)
    for p in placements:
        by_site[p.site_id].append(p)
    assert set(by_site) == {1, 2}
    # Site 1 holds the first range of the scanner's order, site 2 the rest.
    assert max(p.rank for p in by_site[1]) < min(p.rank for p in by_site[2])
    assert all(p.reason.startswith("blend: range ") for p in placements)
    # Both ranges mix dense and sparse items.
    for share in by_site.values():
        assert {plan[p.index].prompt_tokens for p in share} == {40, 2000}
    assert len(by_site[2]) > len(by_site[1])


def test_blend_without_a_serving_site_leaves_items_for_the_policy() -> None:
    plan = items(*[(10, 20, 10, 1)] * 3)
    placements = planned("blend", plan, [Site("x", 1, model="other")])
    assert {p.site_id for p in placements} == {None}
    assert sorted(p.rank for p in placements) == [0, 1, 2]
