"""Site pickers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.routing.types import RoutingRequest, S


@dataclass(slots=True)
class RoundRobinPicker:
    """Contract: for each model, cycles through the candidates by name order, so a site that
    drops out and comes back does not shift everyone else's turn; None when no candidate."""

    name: str = "round_robin"
    _next: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def pick(self, request: RoutingRequest, sites: Sequence[S]) -> S | None:
        if not sites:
            return None
        ordered = sorted(sites, key=lambda site: site.name)
        turn = self._next[request.model]
        self._next[request.model] = turn + 1
        return ordered[turn % len(ordered)]
