"""A routing policy: filters in order, then a picker. Built by name from configuration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.routing.filters import (
    FitsContextFilter,
    HealthyFilter,
    KvBoundFilter,
    NotDrainingFilter,
    QueueBoundFilter,
    ServesModelFilter,
)
from gateway.routing.latency import LeastLatencyScorer
from gateway.routing.mico import MicoOnlinePicker
from gateway.routing.pickers import MinScorePicker, RoundRobinPicker
from gateway.routing.scorers import LeastRequestsScorer, LeastTokensScorer, LedgerTokensScorer
from gateway.routing.types import RoutingRequest, S, SiteFilter, SitePicker

T = TypeVar("T")

POLICY_NAMES = (
    "round_robin",
    "least_requests",
    "least_tokens",
    "least_tokens_guess",
    "mico",
    "least_latency",
)


@dataclass(frozen=True, slots=True)
class Decision(Generic[T]):
    site: T | None
    policy: str
    # How many sites were left after each filter, for explaining a "no site" answer.
    survivors: tuple[tuple[str, int], ...]
    # Site name -> score for every candidate a scoring picker ranked (lower won); empty otherwise.
    scores: Mapping[str, float] = field(default_factory=dict)
    # The predictor's answer length as the request carried it (None: no prediction) ...
    predicted_tokens: int | None = None
    # ... and the answer length routing actually planned with (capped, or max_tokens without one).
    planned_answer_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    name: str
    filters: tuple[SiteFilter, ...]
    picker: SitePicker

    def route(self, request: RoutingRequest, sites: Sequence[S]) -> Decision[S]:
        """Contract: applies the filters in order, then the picker to what survives; records
        the survivors after each filter, the picker's scores and the planned answer length."""
        survivors: list[tuple[str, int]] = []
        candidates = list(sites)
        for site_filter in self.filters:
            candidates = site_filter(request, candidates)
            survivors.append((site_filter.name, len(candidates)))
        pick = self.picker.choose(request, candidates)
        return Decision(
            pick.site,
            self.name,
            tuple(survivors),
            scores=pick.scores,
            predicted_tokens=request.predicted_tokens,
            planned_answer_tokens=request.answer_tokens,
        )


def build_policy(
    name: str, max_site_queue: int | None = None, max_site_queued_tokens: int | None = None
) -> RoutingPolicy:
    """Contract: a fresh policy (own turn counters) for each name in POLICY_NAMES; ValueError
    for any other name. Every policy leaves out draining sites and sites whose queue reached
    the bounds (None: unbounded)."""
    base_filters = (
        ServesModelFilter(),
        HealthyFilter(),
        FitsContextFilter(),
        NotDrainingFilter(),
        QueueBoundFilter(max_site_queue, max_site_queued_tokens),
    )
    if name == "round_robin":
        return RoutingPolicy(name, base_filters, RoundRobinPicker())
    if name == "least_requests":
        return RoutingPolicy(name, base_filters, MinScorePicker(LeastRequestsScorer()))
    if name == "least_tokens":
        return RoutingPolicy(name, base_filters, MinScorePicker(LeastTokensScorer()))
    if name == "least_tokens_guess":
        return RoutingPolicy(name, base_filters, MinScorePicker(LedgerTokensScorer()))
    if name == "mico":
        return RoutingPolicy(name, (*base_filters, KvBoundFilter()), MicoOnlinePicker())
    if name == "least_latency":
        picker = MinScorePicker(LeastLatencyScorer())
        return RoutingPolicy(name, (*base_filters, KvBoundFilter()), picker)
    raise ValueError(f"unknown routing policy {name!r}")
