"""What the batch runner decides, as pure functions: where MICO's group-wise assignment puts each
item of a batch, and how long to wait before an item's next try. (When a batch is settled is the
batch store's rule, gateway/stores/batch_records.py; which failures are tried again is the
error's own, GatewayError.retryable.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.routing.mico import BatchQuery, BatchSite, mico_assign
from gateway.routing.types import UnpredictedPlan, planned_answer_tokens

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

    @property
    def planned_tokens(self) -> int:
        return planned_answer_tokens(self.predicted_tokens, self.max_tokens, self.unpredicted)


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
        reason = f"no healthy site served model '{model}' at assignment: routed when started"
        return [Placement(item.index, None, reason) for item in items]
    ids = {site.name: site.site_id for site in serving}
    queries = [
        BatchQuery(
            id=str(item.index),
            prompt_tokens=item.prompt_tokens,
            predicted_tokens=item.planned_tokens,
            bucket=NO_PREDICTION_BUCKET if item.predicted_bucket is None else item.predicted_bucket,
        )
        for item in items
    ]
    batch_sites = [
        BatchSite(site.name, site.capacity_weight, site.outstanding_tokens, kv_free_tokens=None)
        for site in serving
    ]
    return [
        Placement(item.index, ids[a.site] if a.site is not None else None, f"mico batch: {a.why}")
        for item, a in zip(items, mico_assign(queries, batch_sites), strict=True)
    ]


def retry_delay_s(attempts: int) -> float:
    """Contract: 1 s after the first start, doubling with each further start, at most 30 s."""
    return min(MAX_RETRY_DELAY_S, 2.0 ** max(attempts - 1, 0))
