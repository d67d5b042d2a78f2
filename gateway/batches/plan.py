"""What the batch runner decides, as pure functions: where the group-wise assignment puts each
item of a batch (MICO's, or the cost model's when the gateway's routing profile routes by it),
and how long to wait before an item's next try. (When a batch is settled is the
batch store's rule, gateway/batches/records.py; which failures are tried again is the
error's own, GatewayError.retryable.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.routing.batch_cost import CostQuery, cost_assign
from gateway.routing.completion_cost import CompletionCostModel
from gateway.routing.mico import Assignment, BatchQuery, BatchSite, mico_assign
from gateway.routing.types import (
    RoutableSite,
    RoutingRequest,
    UnpredictedPlan,
    planned_answer_tokens,
)

# Items without a prediction (no predictor, or it failed on them) share one length group.
NO_PREDICTION_BUCKET = 0
MAX_RETRY_DELAY_S = 30.0


class AssignableSite(Protocol):
    """What assignment reads about a site (SiteState has it all)."""

    @property
    def name(self) -> str: ...

    @property
    def site_id(self) -> int: ...

    @property
    def model(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def capacity_weight(self) -> float: ...

    @property
    def outstanding_tokens(self) -> int: ...


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


def retry_delay_s(attempts: int) -> float:
    """Contract: 1 s after the first start, doubling with each further start, at most 30 s."""
    return min(MAX_RETRY_DELAY_S, 2.0 ** max(attempts - 1, 0))
