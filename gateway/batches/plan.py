"""The batch plan, as pure functions: which site each item of a batch goes to, in what order
each site starts its items (`make_plan`), and how long to wait before an item's next try. The
store only persists the plan (each item's site and plan_rank); the runner feeds each site its
items in rank order (gateway/batches/feed.py).

Orders (GATEWAY_BATCH_ORDER): `blend`, BlendServe's resource-aware prefix tree
(gateway/batches/blend.py), which also spreads the batch over sites as ranges of whole subtrees
of equal resource; the others place items by the group-wise assignment (MICO's, or the cost
model's when the gateway's routing profile routes by it) and then order each site's share:
`longest_first` (the longest planned answer first: a site does not end the batch on a long
answer started last), `submission`, or `dfs` (depth-first by prompt prefix, SGLang's lpm-like
order). (When a batch is settled is the store's rule, gateway/batches/records.py; which failures
are tried again is the error's own, GatewayError.retryable.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from gateway.batch_settings import BatchOrder, BatchSettings
from gateway.batches.blend import (
    BlendRequest,
    Roofline,
    blend_order,
    dfs_order,
    split_ranges,
)
from gateway.routing.batch_cost import CostQuery, cost_assign
from gateway.routing.completion_cost import CompletionCostModel
from gateway.routing.mico import Assignment, BatchQuery, BatchSite, mico_assign
from gateway.routing.types import (
    LoadedSite,
    RoutableSite,
    RoutingRequest,
    UnpredictedPlan,
    planned_answer_tokens,
)

# Items without a prediction (no predictor, or it failed on them) share one length group.
NO_PREDICTION_BUCKET = 0
MAX_RETRY_DELAY_S = 30.0


class AssignableSite(LoadedSite, Protocol):
    """What assignment reads about a site (SiteState has it all): its load, and its id."""

    @property
    def site_id(self) -> int: ...


class CostAssignableSite(AssignableSite, RoutableSite, Protocol):
    """What assignment by the cost model reads: everything routing reads, and the site's id."""


@dataclass(frozen=True, slots=True)
class PlanItem:
    """An item as assignment sees it. predicted_tokens is the prediction capped at max_tokens
    (what the site is told), None without one."""

    index: int
    prompt_tokens: int
    max_tokens: int
    predicted_tokens: int | None = None
    predicted_bucket: int | None = None
    unpredicted: UnpredictedPlan = "max_tokens"
    # The prompt, when at hand: the cost model then sees what each site (and the batch's own
    # earlier items) already cache of it.
    prompt_token_ids: tuple[int, ...] = ()
    # The prompt's prefix-block ids (the routing chain, fedllm_contract/block_hash.py), for the
    # prefix-tree orders; empty when not computed.
    block_ids: tuple[int, ...] = ()
    # An answer length known for sure (a benchmark's forced lengths): the order uses it instead
    # of the planned one.
    true_tokens: int | None = None

    @property
    def planned_tokens(self) -> int:
        return planned_answer_tokens(self.predicted_tokens, self.max_tokens, self.unpredicted)

    @property
    def bucket(self) -> int:
        return NO_PREDICTION_BUCKET if self.predicted_bucket is None else self.predicted_bucket


@dataclass(frozen=True, slots=True)
class Placement:
    index: int
    site_id: int | None
    reason: str
    # Its place in its site's start order (the lanes read items by increasing rank).
    rank: int = 0


def plan_batch(
    model: str, items: Sequence[PlanItem], sites: Sequence[AssignableSite]
) -> list[Placement]:
    """Contract: one Placement per item, in the order of `items`, from `mico_assign` over the
    healthy sites serving `model`, each starting from its current outstanding tokens. A batch is
    dispatched a few items per site at a time, so the whole batch is never resident at once: the
    KV bound is left to the sites' own admission, and prepare() already checked that every item
    fits the context of every healthy site. With no such site, every item gets site None and a
    reason; it is then placed by the routing policy when it starts."""
    serving = [site for site in sites if site.healthy and site.model == model]
    if not serving:
        return _unplaced(model, items)
    queries = [
        BatchQuery(str(item.index), item.prompt_tokens, item.planned_tokens, item.bucket)
        for item in items
    ]
    batch_sites = [
        BatchSite(site.name, site.capacity_weight, site.outstanding_tokens, kv_free_tokens=None)
        for site in serving
    ]
    return _placements(items, serving, mico_assign(queries, batch_sites), "mico batch")


def plan_batch_by_cost(
    model: str,
    items: Sequence[PlanItem],
    sites: Sequence[CostAssignableSite],
    cost: CompletionCostModel,
) -> list[Placement]:
    """Contract: as plan_batch, by the cost model's group-wise rule (cost_assign): each item
    where it would complete soonest given what the batch already put on each site."""
    serving = [site for site in sites if site.healthy and site.model == model]
    if not serving:
        return _unplaced(model, items)
    queries = [
        CostQuery(
            str(item.index),
            RoutingRequest(
                model,
                item.prompt_tokens,
                item.max_tokens,
                item.predicted_tokens,
                item.predicted_bucket,
                item.unpredicted,
                prompt_token_ids=item.prompt_token_ids,
            ),
            item.bucket,
        )
        for item in items
    ]
    return _placements(items, serving, cost_assign(queries, serving, cost), "cost batch")


def _unplaced(model: str, items: Sequence[PlanItem]) -> list[Placement]:
    reason = f"no healthy site served model '{model}' at assignment: routed when started"
    return [Placement(item.index, None, reason) for item in items]


def _placements(
    items: Sequence[PlanItem],
    serving: Sequence[AssignableSite],
    assignments: Sequence[Assignment],
    rule: str,
) -> list[Placement]:
    ids = {site.name: site.site_id for site in serving}
    return [
        Placement(item.index, ids[a.site] if a.site is not None else None, f"{rule}: {a.why}")
        for item, a in zip(items, assignments, strict=True)
    ]


def roofline(settings: BatchSettings) -> Roofline:
    return Roofline(
        peak_flops=settings.blend_peak_tflops * 1e12,
        memory_bytes_per_s=settings.blend_memory_gbps * 1e9,
        model_params=settings.blend_model_params_b * 1e9,
        kv_bytes_per_token=float(settings.blend_kv_bytes_per_token),
    )


def make_plan(
    model: str,
    items: Sequence[PlanItem],
    sites: Sequence[AssignableSite],
    settings: BatchSettings,
    cost: CompletionCostModel | None = None,
) -> list[Placement]:
    """Contract: one Placement per item, in the order of `items`, each with its site and its
    rank in that site's start order (ranks distinct within the batch). `blend` cuts its order
    into one range per healthy site serving `model` (shares by capacity weight); the other
    orders place by plan_batch / plan_batch_by_cost and rank by `settings.order`."""
    if settings.order == "blend":
        return _blend_plan(model, items, sites, settings)
    # With a cost model, the sites are the registry's (SiteState), which routing reads too.
    placements = (
        plan_batch(model, items, sites)
        if cost is None
        else plan_batch_by_cost(model, items, cast(Sequence[CostAssignableSite], sites), cost)
    )
    ranks = {pos: rank for rank, pos in enumerate(item_order(items, settings.order))}
    return [Placement(p.index, p.site_id, p.reason, ranks[pos]) for pos, p in enumerate(placements)]


def item_order(
    items: Sequence[PlanItem],
    order: BatchOrder,
    roof: Roofline | None = None,
    block_tokens: int = 16,
) -> list[int]:
    """Contract: the positions of `items` (0..n-1, each once) in start order."""
    if order == "submission":
        return sorted(range(len(items)), key=lambda pos: items[pos].index)
    if order == "longest_first":
        return sorted(
            range(len(items)), key=lambda pos: (-items[pos].planned_tokens, items[pos].index)
        )
    requests = blend_requests(items)
    if order == "dfs":
        return dfs_order(requests)
    return blend_order(requests, roof or Roofline(), block_tokens).order


def blend_requests(items: Sequence[PlanItem]) -> list[BlendRequest]:
    """The items as the prefix tree sees them: the true answer length where known, else the
    planned one."""
    return [
        BlendRequest(
            item.block_ids,
            item.prompt_tokens,
            item.planned_tokens if item.true_tokens is None else item.true_tokens,
        )
        for item in items
    ]


def _blend_plan(
    model: str,
    items: Sequence[PlanItem],
    sites: Sequence[AssignableSite],
    settings: BatchSettings,
) -> list[Placement]:
    requests = blend_requests(items)
    blend = blend_order(
        requests,
        roofline(settings),
        settings.blend_block_tokens,
        split_budget=settings.blend_split_budget,
    )
    serving = [site for site in sites if site.healthy and site.model == model]
    site_ids: list[int | None]
    if not serving:
        reason = f"no healthy site served model '{model}' at assignment: routed when started"
        ranges, site_ids, reasons = [blend.order], [None], [reason]
    else:
        ranges = split_ranges(blend, requests, [site.capacity_weight for site in serving])
        site_ids = [site.site_id for site in serving]
        reasons = [
            f"blend: range {k + 1} of {len(serving)} of the prefix tree (batch density "
            f"{blend.root_density:.2f})"
            for k in range(len(serving))
        ]
    out: dict[int, Placement] = {}
    for part, site_id, reason in zip(ranges, site_ids, reasons, strict=True):
        for position in part:
            out[position] = Placement(items[position].index, site_id, reason, len(out))
    return [out[pos] for pos in range(len(items))]


def retry_delay_s(attempts: int) -> float:
    """Contract: 1 s after the first start, doubling with each further start, at most 30 s."""
    return min(MAX_RETRY_DELAY_S, 2.0 ** max(attempts - 1, 0))
