"""A routing policy: filters in order, then a picker. Built by name from configuration."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.routing.filters import FitsContextFilter, HealthyFilter, ServesModelFilter
from gateway.routing.pickers import RoundRobinPicker
from gateway.routing.types import RoutingRequest, S, SiteFilter, SitePicker

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Decision(Generic[T]):
    site: T | None
    policy: str
    # How many sites were left after each filter, for explaining a "no site" answer.
    survivors: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    name: str
    filters: tuple[SiteFilter, ...]
    picker: SitePicker

    def route(self, request: RoutingRequest, sites: Sequence[S]) -> Decision[S]:
        survivors: list[tuple[str, int]] = []
        candidates = list(sites)
        for site_filter in self.filters:
            candidates = site_filter(request, candidates)
            survivors.append((site_filter.name, len(candidates)))
        return Decision(self.picker.pick(request, candidates), self.name, tuple(survivors))


def build_policy(name: str) -> RoutingPolicy:
    base_filters = (ServesModelFilter(), HealthyFilter(), FitsContextFilter())
    if name == "round_robin":
        return RoutingPolicy(name, base_filters, RoundRobinPicker())
    raise ValueError(f"unknown routing policy {name!r}")
