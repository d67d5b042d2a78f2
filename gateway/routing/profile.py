"""A routing profile: filters in order, then weighted scorers, then a picker (the Gateway API
Inference Extension's scheduler profile). Built from configuration by gateway/routing/catalogue.py.

For each decision: the filters narrow the sites; every scorer gives each survivor a value in
[0, 1]; a survivor's total is the sum of value x weight over the scorers; the picker chooses from
the totals. Parts that learn from decisions (a session's last site, what a site was sent) are told
where the request went.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.routing.completion_cost import CompletionCostModel
from gateway.routing.types import (
    RoutingObserver,
    RoutingRequest,
    S,
    Scored,
    SiteFilter,
    SitePicker,
    SiteScorer,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Decision(Generic[T]):
    site: T | None
    policy: str
    # How many sites were left after each filter, for explaining a "no site" answer.
    survivors: tuple[tuple[str, int], ...]
    # Site name -> what the pick minimised, for every scored candidate (lower won): a profile of
    # one cost scorer records the cost itself (requests, tokens, seconds); otherwise the
    # weighted shortfall from a perfect score, sum of weight x (1 - value). Empty without
    # scorers (round robin).
    scores: Mapping[str, float] = field(default_factory=dict)
    # The predictor's answer length as the request carried it (None: no prediction) ...
    predicted_tokens: int | None = None
    # ... and the answer length routing actually planned with (capped, or max_tokens without one).
    planned_answer_tokens: int | None = None
    # Scorer name -> site name -> value in [0, 1] (higher was better), every scorer's view.
    scorer_values: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: SiteScorer
    weight: float

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"scorer {self.scorer.name}: weight must be > 0, got {self.weight}")


@dataclass(frozen=True, slots=True)
class RoutingProfile:
    name: str
    filters: tuple[SiteFilter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: SitePicker
    observers: tuple[RoutingObserver, ...] = ()
    # The cost model a profile routes by, when it has one: the batch API assigns by it too.
    batch_cost: CompletionCostModel | None = None

    def route(self, request: RoutingRequest, sites: Sequence[S]) -> Decision[S]:
        """Contract: applies the filters in order, scores what survives, lets the picker choose
        from the weighted totals and tells the observers; records the survivors after each
        filter, what the pick minimised (Decision.scores) and the planned answer length."""
        survivors: list[tuple[str, int]] = []
        candidates = list(sites)
        for site_filter in self.filters:
            candidates = site_filter(request, candidates)
            survivors.append((site_filter.name, len(candidates)))
        scored = [(w, w.scorer.score(request, candidates)) for w in self.scorers]
        totals = [0.0] * len(candidates)
        for weighted, result in scored:
            for i, value in enumerate(result.values):
                totals[i] += weighted.weight * value
        site = self.picker.pick(request, candidates, totals)
        if site is not None:
            for observer in self.observers:
                observer.routed(request, site)
        return Decision(
            site,
            self.name,
            tuple(survivors),
            scores=self._explained(candidates, scored, totals),
            predicted_tokens=request.predicted_tokens,
            planned_answer_tokens=request.answer_tokens,
            scorer_values={
                w.scorer.name: {s.name: v for s, v in zip(candidates, r.values, strict=True)}
                for w, r in scored
            },
        )

    @staticmethod
    def _explained(
        candidates: Sequence[S],
        scored: Sequence[tuple[WeightedScorer, Scored]],
        totals: Sequence[float],
    ) -> dict[str, float]:
        if not scored:
            return {}
        if len(scored) == 1 and scored[0][1].costs is not None:
            costs = scored[0][1].costs
            return {site.name: cost for site, cost in zip(candidates, costs, strict=True)}
        perfect = sum(weighted.weight for weighted, _ in scored)
        return {site.name: perfect - total for site, total in zip(candidates, totals, strict=True)}
