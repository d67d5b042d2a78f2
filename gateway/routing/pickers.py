"""Site pickers: round robin (the baseline) and the highest weighted score."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from gateway.routing.load import is_tie
from gateway.routing.types import RoutingRequest, S

TieKey = Callable[[RoutingRequest], Hashable]


def by_model(request: RoutingRequest) -> Hashable:
    return request.model


def by_model_and_bucket(request: RoutingRequest) -> Hashable:
    """MICO alternates equally loaded sites per predicted length bucket."""
    return (request.model, request.predicted_bucket)


TIE_KEYS: dict[str, TieKey] = {"model": by_model, "model_bucket": by_model_and_bucket}


@dataclass(slots=True)
class RoundRobinPicker:
    """Contract: for each model, cycles through the candidates by name order, so a site that
    drops out and comes back does not shift everyone else's turn; scores are not read; None
    when no candidate."""

    name: str = "round_robin"
    _next: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def pick(
        self, request: RoutingRequest, sites: Sequence[S], totals: Sequence[float]
    ) -> S | None:
        if not sites:
            return None
        ordered = sorted(sites, key=lambda site: site.name)
        turn = self._next[request.model]
        self._next[request.model] = turn + 1
        return ordered[turn % len(ordered)]


@dataclass(slots=True)
class MaxScorePicker:
    """Contract: picks the candidate with the highest total score. Candidates whose totals tie
    (equal up to float rounding) take turns: the n-th tied pick for a tie key (the model by
    default) takes the (n mod ties)-th of the tied sites in name order. Turns rather than "first
    name wins" because the load signals lag a burst: until a dispatch shows up in the ledger,
    equal sites must not all receive the burst. Deterministic for a given sequence of calls.
    None when no candidate."""

    tie_key: TieKey = by_model
    name: str = "max_score"
    _turns: dict[Hashable, int] = field(default_factory=lambda: defaultdict(int))

    def pick(
        self, request: RoutingRequest, sites: Sequence[S], totals: Sequence[float]
    ) -> S | None:
        if not sites:
            return None
        best = max(totals)
        ties = sorted(
            (site for site, total in zip(sites, totals, strict=True) if is_tie(total, best)),
            key=lambda site: site.name,
        )
        if len(ties) == 1:
            return ties[0]
        key = self.tie_key(request)
        turn = self._turns[key]
        self._turns[key] = turn + 1
        return ties[turn % len(ties)]
