"""Offload negotiation: a site that has run dry takes queued work from a site with a queue.

Every interval the coordinator reads the sites' last load reports (memory only) and plans:
a taker is a healthy site with nothing queued and free batch slots; a giver is a healthy site
serving the same model with queued requests that have not started. An offload pays only when
the wait it saves exceeds what moving costs: the giver's expected wait is its predicted
remaining tokens over its decode rate, the cost is a configured transfer time (re-dispatch and
re-prefill). The giver releases the requests (they have not started, so nothing is lost); each
one's Dispatch then places it elsewhere, and its client stream goes on unaffected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.metrics import GatewayMetrics
from gateway.sites.interface import LoadView, SiteCallError, SiteInfoView
from gateway.sites.registry import SiteRegistry

log = logging.getLogger(__name__)
_MIN_RATE = 1.0  # tokens/s; a site that reports no rate yet is treated as very slow


class OffloadSite(Protocol):
    """What offload planning reads about a site (SiteState provides it)."""

    @property
    def name(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def report(self) -> LoadView | None: ...

    @property
    def info(self) -> SiteInfoView | None: ...

    @property
    def can_release_queued(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    giver: str
    taker: str
    count: int
    wait_saved_s: float


def _free_slots(site: OffloadSite) -> int:
    report, info = site.report, site.info
    if report is None or info is None:
        return 0
    return max(info.max_num_seqs - report.running_requests, 0)


def _expected_wait_s(site: OffloadSite) -> float:
    report = site.report
    if report is None:
        return 0.0
    return report.predicted_remaining_tokens / max(report.decode_tokens_per_s, _MIN_RATE)


def plan_offloads(sites: Sequence[OffloadSite], transfer_cost_s: float) -> list[OffloadPlan]:
    """Contract: only healthy sites with reports take part; a taker has no queue and free slots;
    a giver has queued requests and can release them; a plan moves at most the giver's queue
    and the taker's free slots, only between sites of the same model, and only when the
    giver's expected wait exceeds the transfer cost. Longest waits are relieved first."""
    live = [s for s in sites if s.healthy and s.report is not None]
    takers = {s.name: _free_slots(s) for s in live if s.report and s.report.queued_requests == 0}
    givers = sorted(
        # An engine that cannot hand back its queue (an OpenAI-compatible one) only takes.
        (s for s in live if s.can_release_queued and s.report and s.report.queued_requests > 0),
        key=_expected_wait_s,
        reverse=True,
    )
    plans: list[OffloadPlan] = []
    for giver in givers:
        wait = _expected_wait_s(giver)
        if wait <= transfer_cost_s:
            continue
        queued = giver.report.queued_requests if giver.report else 0
        for taker in sorted(live, key=lambda s: -takers.get(s.name, 0)):
            free = takers.get(taker.name, 0)
            if queued == 0 or free == 0 or taker.model != giver.model:
                continue
            count = min(queued, free)
            plans.append(OffloadPlan(giver.name, taker.name, count, wait))
            takers[taker.name] -= count
            queued -= count
    return plans


class OffloadCoordinator:
    def __init__(
        self,
        registry: SiteRegistry,
        interval_s: float,
        transfer_cost_s: float,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._registry = registry
        self._interval_s = interval_s
        self._transfer_cost_s = transfer_cost_s
        self._metrics = metrics or GatewayMetrics()
        self.released = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.negotiate_once()

    async def negotiate_once(self) -> int:
        released = 0
        for plan in plan_offloads(self._registry.all(), self._transfer_cost_s):
            giver = self._registry.get(plan.giver)
            if giver is None:
                continue
            try:
                ids = await giver.client.release_queued(plan.count)
            except SiteCallError as exc:
                log.warning("offload from %s failed: %s", plan.giver, exc)
                continue
            released += len(ids)
            self._metrics.offload_releases.labels(plan.giver, plan.taker).inc(len(ids))
            if ids:
                log.info(
                    "offload: %s released %d queued request(s) for %s (wait saved %.2fs)",
                    plan.giver,
                    len(ids),
                    plan.taker,
                    plan.wait_saved_s,
                )
        self.released += released
        return released
