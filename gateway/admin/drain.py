"""An operator's drain of a site: it takes nothing new, its queued work moves elsewhere, and its
running work finishes where it is.

Draining marks the site (routing's NotDrainingFilter then leaves it out) and asks it to release
its queued, not-started requests; each one's Dispatch places it on another site, as offload
does, and its client's stream goes on. Requests can still reach the site's queue after that
(routed just before the drain, batch items placed earlier), so while the site drains, its queue
is released again every interval. Requests are released only while another healthy site that is
not draining serves the same model; with none, they stay queued and run on the drained site.

The mark lives in this gateway's memory: with several gateways, drain the site on each one. It
is cleared by undrain (or a restart).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from gateway.sites.interface import SiteCallError
from gateway.sites.registry import SiteRegistry, SiteState

log = logging.getLogger(__name__)
# Release everything queued (the site releases at most what it has).
_ALL_QUEUED = 1 << 20


@dataclass(frozen=True, slots=True)
class DrainView:
    site: str
    draining: bool
    # Queued requests the site handed back for other sites by this call.
    released: int
    # What the site last reported: still queued there, and running to their end there.
    queued_requests: int
    running_requests: int


class SiteDrainer:
    def __init__(self, registry: SiteRegistry, interval_s: float) -> None:
        self._registry = registry
        self._interval_s = interval_s

    async def drain(self, name: str) -> DrainView | None:
        """Marks the site draining and releases its queue; None for an unknown site."""
        site = self._registry.get(name)
        if site is None:
            return None
        if not site.draining:
            log.info("draining site %s", name)
        site.draining = True
        return self._view(site, await self._release(site))

    async def undrain(self, name: str) -> DrainView | None:
        site = self._registry.get(name)
        if site is None:
            return None
        if site.draining:
            log.info("site %s takes new requests again", name)
        site.draining = False
        return self._view(site, 0)

    def draining(self) -> list[str]:
        return sorted(site.name for site in self._registry.all() if site.draining)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            for site in self._registry.all():
                queued = site.report.queued_requests if site.report is not None else 0
                if site.draining and queued > 0:
                    await self._release(site)

    def _has_other_home(self, site: SiteState) -> bool:
        return any(
            other.name != site.name
            and other.model == site.model
            and other.healthy
            and not other.draining
            for other in self._registry.all()
        )

    async def _release(self, site: SiteState) -> int:
        # An OpenAI-compatible engine keeps its queue: draining it only stops new requests.
        if not site.healthy or not site.can_release_queued or not self._has_other_home(site):
            return 0
        try:
            released = await site.client.release_queued(_ALL_QUEUED)
        except SiteCallError as exc:
            log.warning("drain of %s: could not release its queue: %s", site.name, exc)
            return 0
        if released:
            log.info("drain of %s: released %d queued request(s)", site.name, len(released))
        return len(released)

    def _view(self, site: SiteState, released: int) -> DrainView:
        report = site.report
        return DrainView(
            site=site.name,
            draining=site.draining,
            released=released,
            queued_requests=report.queued_requests if report is not None else 0,
            running_requests=report.running_requests if report is not None else 0,
        )
