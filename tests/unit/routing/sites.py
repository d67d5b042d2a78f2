"""A frozen stand-in for SiteState with every signal routing may read."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.routing.types import RoutingRequest, SiteLatency


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


def request(
    prompt: int = 10,
    max_tokens: int = 10,
    model: str = "m",
    predicted: int | None = None,
    bucket: int | None = None,
) -> RoutingRequest:
    return RoutingRequest(
        model=model,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        predicted_tokens=predicted,
        predicted_bucket=bucket,
    )
