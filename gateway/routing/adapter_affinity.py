"""Adapter affinity: a request of a LoRA adapter prefers the sites where the adapter already is,
device slot over host memory over disk (llm-d's `lora-affinity` scorer, with the host tier of
vLLM's and our engine's `max_cpu_loras` between its "active" and "can load").

Why a scorer of its own beside the load time in `completion_cost`: a site loading an adapter
into a full set of slots evicts another, whose next request then pays a load in turn; over many
adapters with Zipf popularity, sending each adapter where it is keeps the popular ones resident
and the slots from thrashing, which no one request's completion time sees. Weighted against the
load scorers, it yields when a site holding the adapter is loaded well beyond the others.

Placement: when no candidate holds the adapter, every candidate scores the same here and the load
scorers choose the least loaded site that serves it (the `serves_model` filter keeps only
those); the adapter is then recorded as routed there (RecordAdapter), so the rest of a burst
follows it instead of loading it on every site.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.routing.adapter_residency import AdapterTier
from gateway.routing.types import RoutableSite, RoutingRequest, Scored

DEFAULT_HOST_VALUE = 0.5
# How routing treats a request's LoRA adapter (GATEWAY_ADAPTER_ROUTING): "affinity" charges a
# cold adapter's load in completion_cost and runs the adapter_affinity scorer; "blind" does
# neither (every site the same for any adapter it serves), the arm the adapter-routing study
# (fedsim/adapter_study.py) compares it with.
AdapterRouting = Literal["affinity", "blind"]
ADAPTER_ROUTINGS: tuple[AdapterRouting, ...] = ("affinity", "blind")


@dataclass(frozen=True, slots=True)
class AdapterAffinity:
    """Contract: for a request of an adapter, 1.0 on a site holding it in a device slot,
    `host_value` on one holding it in host memory only, 0.0 elsewhere; 1.0 everywhere for a
    request of the base model (no preference)."""

    host_value: float = DEFAULT_HOST_VALUE
    name: str = "adapter_affinity"
    reads_adapters: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.host_value <= 1.0:
            raise ValueError(
                f"adapter_affinity: host_value must be in [0, 1], got {self.host_value}"
            )

    def score(self, request: RoutingRequest, sites: Sequence[RoutableSite]) -> Scored:
        adapter = request.adapter
        if adapter is None:
            return Scored(tuple(1.0 for _ in sites))
        values = {AdapterTier.DEVICE: 1.0, AdapterTier.HOST: self.host_value, AdapterTier.DISK: 0.0}
        return Scored(tuple(values[site.adapter_residency.tier(adapter)] for site in sites))


@dataclass(frozen=True, slots=True)
class RecordAdapter:
    """Contract: tells the chosen site's residency view that the request's adapter was routed
    there (nothing for a base request). Added to every profile with a part that reads adapters."""

    def routed(self, request: RoutingRequest, site: RoutableSite) -> None:
        if request.adapter is not None:
            site.adapter_residency.routed(request.adapter)


def reads_adapters(part: object) -> bool:
    """A part (or the cost a scorer normalizes) that reads the sites' adapter residency."""
    inner = getattr(part, "cost", None)
    return bool(getattr(part, "reads_adapters", False) or getattr(inner, "reads_adapters", False))
