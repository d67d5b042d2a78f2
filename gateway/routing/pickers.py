"""Site pickers: round robin (the baseline) and the lowest score of a SiteScorer."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from gateway.routing.load import is_tie
from gateway.routing.types import Pick, RoutingRequest, S, SiteScorer

TieKey = Callable[[RoutingRequest], Hashable]


def by_model(request: RoutingRequest) -> Hashable:
    return request.model


@dataclass(slots=True)
class RoundRobinPicker:
    """Contract: for each model, cycles through the candidates by name order, so a site that
    drops out and comes back does not shift everyone else's turn; None when no candidate."""

    name: str = "round_robin"
    _next: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def pick(self, request: RoutingRequest, sites: Sequence[S]) -> S | None:
        return self.choose(request, sites).site

    def choose(self, request: RoutingRequest, sites: Sequence[S]) -> Pick[S]:
        if not sites:
            return Pick(None)
        ordered = sorted(sites, key=lambda site: site.name)
        turn = self._next[request.model]
        self._next[request.model] = turn + 1
        return Pick(ordered[turn % len(ordered)])


@dataclass(slots=True)
class MinScorePicker:
    """Contract: scores every candidate with `scorer` and picks the lowest score; the scores of
    all candidates come back with the pick. Candidates whose scores tie (equal up to float
    rounding) take turns: the n-th tied pick for a tie key (the model by default) takes the
    (n mod ties)-th of the tied sites in name order. Turns rather than "first name wins" because
    the load signals lag a burst: until a dispatch shows up in the ledger, equal sites must not
    all receive the burst. Deterministic for a given sequence of calls. None when no candidate.
    Its name is the scorer's."""

    scorer: SiteScorer
    tie_key: TieKey = by_model
    _turns: dict[Hashable, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def name(self) -> str:
        return self.scorer.name

    def pick(self, request: RoutingRequest, sites: Sequence[S]) -> S | None:
        return self.choose(request, sites).site

    def choose(self, request: RoutingRequest, sites: Sequence[S]) -> Pick[S]:
        if not sites:
            return Pick(None)
        scores = {site.name: self.scorer.score(request, site) for site in sites}
        best = min(scores.values())
        ties = sorted((s for s in sites if is_tie(scores[s.name], best)), key=lambda s: s.name)
        if len(ties) == 1:
            return Pick(ties[0], scores)
        key = self.tie_key(request)
        turn = self._turns[key]
        self._turns[key] = turn + 1
        return Pick(ties[turn % len(ties)], scores)
