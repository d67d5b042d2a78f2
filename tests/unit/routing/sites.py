"""A frozen stand-in for SiteState with every signal routing may read."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.routing.adapter_residency import SiteAdapters
from gateway.routing.pickers import MaxScorePicker
from gateway.routing.profile import RoutingProfile, WeightedScorer
from gateway.routing.scorers import LowestCost
from gateway.routing.types import (
    NO_MATCH,
    PrefixMatch,
    PrefixView,
    RoutingRequest,
    SiteCost,
    SiteLatency,
)


@dataclass(frozen=True)
class KnownPrefix:
    """A site's cache as a fixed answer: `cached` tokens of every prompt, `device` of them in
    device memory; what was routed there is counted."""

    cached: int = 0
    device: int | None = None
    routed_requests: list[RoutingRequest] = field(default_factory=list, compare=False)

    def match(self, request: RoutingRequest) -> PrefixMatch:
        if not self.cached:
            return NO_MATCH
        device = self.cached if self.device is None else self.device
        return PrefixMatch(self.cached, device)

    def routed(self, request: RoutingRequest) -> None:
        self.routed_requests.append(request)


@dataclass(frozen=True)
class Site:
    name: str
    healthy: bool = True
    model: str = "m"
    max_model_len: int | None = 1024
    capacity_weight: float = 1.0
    kv_capacity_tokens: int | None = None
    outstanding_tokens: int = 0
    in_flight: int = 0
    draining: bool = False
    queued_requests: int = 0
    queued_tokens: int = 0
    ledger_tokens: int = 0
    latency: SiteLatency = field(default_factory=SiteLatency)
    prefix: PrefixView = field(default_factory=KnownPrefix)
    prefill_tokens_per_s: float | None = None
    adapters: frozenset[str] = frozenset()
    adapter_residency: SiteAdapters = field(default_factory=SiteAdapters, compare=False)


def resident(
    device: tuple[str, ...] = (), host: tuple[str, ...] = (), load_s: float = 0.0
) -> SiteAdapters:
    """A residency view as a site's load report would set it."""
    view = SiteAdapters()
    view.apply(device, host, load_s)
    return view


def request(
    prompt: int = 10,
    max_tokens: int = 10,
    model: str = "m",
    predicted: int | None = None,
    bucket: int | None = None,
    session: str | None = None,
    adapter: str | None = None,
) -> RoutingRequest:
    return RoutingRequest(
        model=model,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        predicted_tokens=predicted,
        predicted_bucket=bucket,
        session_key=session,
        adapter=adapter,
    )


def lowest(cost: SiteCost) -> RoutingProfile:
    """A profile with no filter that picks the lowest `cost` (its decisions record the costs)."""
    return RoutingProfile("lowest", (), (WeightedScorer(LowestCost(cost), 1.0),), MaxScorePicker())
