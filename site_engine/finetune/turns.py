"""Whose fine-tuning job trains next on a site: tenants (the gateway's keys) take turns a unit at
a time, round robin, and each tenant's jobs go oldest first (issue 67: a key's 4-step job waited
90 s behind another key's 2,500-step job when the site trained oldest first).

A unit is time-bounded (site_engine/finetune/pacing.py), so a turn a unit is about an equal
share of the site's training time for each tenant with work, however many jobs or steps each
has. No torch here: the turns are arithmetic, tested on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class TenantTurns:
    """The tenant whose unit ran last; the next unit is the following tenant's."""

    last: str | None = None

    def order(self, jobs: Sequence[T], tenant_of: Callable[[T], str]) -> list[T]:
        """Each tenant's oldest job of `jobs` (given oldest first), in the order they are
        offered the next unit: the tenant after the one served last first, round the circle
        of tenants in the order of their oldest job. The caller runs the first that can run."""
        firsts: dict[str, T] = {}
        for job in jobs:
            firsts.setdefault(tenant_of(job), job)
        tenants = list(firsts)
        if self.last in firsts:
            after = tenants.index(self.last) + 1
            tenants = tenants[after:] + tenants[:after]
        return [firsts[tenant] for tenant in tenants]

    def served(self, tenant: str) -> None:
        self.last = tenant
