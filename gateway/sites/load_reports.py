"""Follows every site's load-report stream, so routing and offload read fresh load in memory."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.sites.interface import SiteCallError
from gateway.sites.registry import SiteRegistry, SiteState

log = logging.getLogger(__name__)
_RETRY_S = 1.0


class LoadReportListener:
    def __init__(self, registry: SiteRegistry, interval_ms: int, stale_after_s: float) -> None:
        self._registry = registry
        self._interval_ms = interval_ms
        self._stale_after_s = stale_after_s

    async def run(self) -> None:
        await asyncio.gather(*(self._follow(site) for site in self._registry.all()))

    async def _follow(self, site: SiteState) -> None:
        while True:
            try:
                async for report in site.client.load_reports(self._interval_ms):
                    site.apply_report(report)
            except SiteCallError as exc:
                log.debug("%s; reconnecting", exc)
            await asyncio.sleep(_RETRY_S)

    def stale(self, site: SiteState, now: float | None = None) -> bool:
        """A site that reported before and has been silent too long (reports stalled)."""
        if site.report is None:
            return False
        return (now if now is not None else time.monotonic()) - site.report_at > self._stale_after_s
