"""Site scorers: one value in [0, 1] per candidate, higher is better; a profile sums them with
weights (gateway/routing/profile.py), as the Gateway API Inference Extension's scheduler does.

Most scorers normalize a cost (gateway/routing/costs.py) over the candidates of one decision:
- "range": (worst - cost) / (worst - best); every candidate whose cost ties the best (up to float
  rounding) scores exactly 1, so a profile of one such scorer picks what the lowest cost picks.
  Scale-free: it ranks, but a 1% difference spans the whole range.
- "ratio": best / cost; keeps proportions (a site twice as slow scores 0.5), which is what a
  weighted sum with another scorer needs. For costs > 0 (seconds of completion).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.routing.load import is_tie
from gateway.routing.types import RoutableSite, RoutingRequest, Scored, SiteCost

Normalization = Literal["range", "ratio"]
NORMALIZATIONS: tuple[Normalization, ...] = ("range", "ratio")


def normalize_costs(costs: Sequence[float], how: Normalization) -> tuple[float, ...]:
    """Contract: one value in [0, 1] per cost, as the module docstring defines; costs that tie
    the lowest score exactly 1.0; an empty input gives an empty output."""
    if not costs:
        return ()
    best, worst = min(costs), max(costs)
    if how == "ratio":
        return tuple(
            1.0 if is_tie(c, best) or c <= 0 else min(1.0, max(0.0, best / c)) for c in costs
        )
    span = worst - best
    return tuple(1.0 if is_tie(c, best) else (worst - c) / span for c in costs)


@dataclass(frozen=True, slots=True)
class LowestCost:
    """Contract: scores each candidate by its cost, normalized over the candidates
    (normalize_costs); the raw costs come back with the values. Named after its cost."""

    cost: SiteCost
    normalize: Normalization = "range"

    @property
    def name(self) -> str:
        return self.cost.name

    def score(self, request: RoutingRequest, sites: Sequence[RoutableSite]) -> Scored:
        costs = tuple(self.cost.cost(request, site) for site in sites)
        return Scored(normalize_costs(costs, self.normalize), costs)
