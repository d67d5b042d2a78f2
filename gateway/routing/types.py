"""Contracts of routing: a policy is filters (who may take the request) then a picker (who does).

Every part reads only in-memory state, so a routing decision never waits on I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class RoutableSite(Protocol):
    """What routing may read about a site."""

    @property
    def name(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def model(self) -> str: ...

    @property
    def max_model_len(self) -> int | None: ...


S = TypeVar("S", bound=RoutableSite)


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    model: str
    prompt_tokens: int
    max_tokens: int
    predicted_tokens: int | None = None


class SiteFilter(Protocol):
    """Keeps the sites that may take the request; order is preserved, nothing is added."""

    @property
    def name(self) -> str: ...

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]: ...


class SitePicker(Protocol):
    """Chooses one site among the filtered candidates, or None when there are none."""

    @property
    def name(self) -> str: ...

    def pick(self, request: RoutingRequest, sites: Sequence[S]) -> S | None: ...
