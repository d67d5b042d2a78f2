"""Site costs: a number per (request, site), lower is better, in the cost's own unit. A scorer
turns one into a score in [0, 1] (LowestCost in gateway/routing/scorers.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.routing.load import normalized
from gateway.routing.types import RoutableSite, RoutingRequest


@dataclass(frozen=True, slots=True)
class RequestCountCost:
    """Contract: in_flight / capacity_weight, the request-count baseline; it ignores how long
    the requests are, which is exactly what token-based policies are measured against."""

    name: str = "least_requests"

    def cost(self, request: RoutingRequest, site: RoutableSite) -> float:
        return normalized(site.in_flight, site.capacity_weight)


@dataclass(frozen=True, slots=True)
class TokenLoadCost:
    """Contract: (outstanding_tokens + prompt + planned answer) / capacity_weight: the site's
    capacity-normalized token load after this request is placed there. Adding the request
    matters only between sites of unequal weight, where it favours the bigger one, as it should:
    the same request raises a small site's normalized load more."""

    name: str = "least_tokens"

    def cost(self, request: RoutingRequest, site: RoutableSite) -> float:
        return normalized(site.outstanding_tokens + request.total_tokens, site.capacity_weight)


@dataclass(frozen=True, slots=True)
class LedgerTokensCost:
    """Contract: (ledger_tokens + prompt + planned answer) / capacity_weight: least_tokens over
    the gateway's own ledger alone, never the site's reports. This is the token balancing of
    routers without a length predictor (llm-d's pending-tokens scorer, AIBrix's token_load): what
    they charge a site is what they sent it, with the answer guessed, not what the site says.
    Paired with GATEWAY_PLAN_WITHOUT_PREDICTION=prompt_ratio, the guess is 1.5x the prompt."""

    name: str = "least_tokens_guess"

    def cost(self, request: RoutingRequest, site: RoutableSite) -> float:
        return normalized(site.ledger_tokens + request.total_tokens, site.capacity_weight)
