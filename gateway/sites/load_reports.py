"""Follows every site's load-report stream, so routing and offload read fresh load in memory,
and, for sites that cache prefixes with our block ids, their cache events into the site's
prefix index (gateway/routing/prefix/)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fedllm_contract.block_hash import HASH_SCHEME
from gateway.routing.prefix.site_index import ApplyOutcome
from gateway.sites.interface import SiteCallError
from gateway.sites.registry import SiteRegistry, SiteState

log = logging.getLogger(__name__)
_RETRY_S = 1.0


def wants_cache_events(site: SiteState) -> bool:
    """The site caches prefixes and names its blocks as this gateway does."""
    info = site.info
    return info is not None and info.prefix_caching and info.block_hash_scheme == HASH_SCHEME


class LoadReportListener:
    """One task per site follows its stream: the sites of the start from `run`, a site that
    joins later from `follow`; `unfollow` ends a leaving site's."""

    def __init__(self, registry: SiteRegistry, interval_ms: int, stale_after_s: float) -> None:
        self._registry = registry
        self._interval_ms = interval_ms
        self._stale_after_s = stale_after_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        for site in self._registry.all():
            self.follow(site)
        try:
            await asyncio.Event().wait()  # the followers run until the gateway stops
        finally:
            for name in list(self._tasks):
                await self.unfollow(name)

    def follow(self, site: SiteState) -> None:
        """Starts following the site's load reports (no-op when already followed)."""
        if site.name not in self._tasks:
            self._tasks[site.name] = asyncio.create_task(
                self._follow(site), name=f"load-reports-{site.name}"
            )

    async def unfollow(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, site: SiteState) -> None:
        while True:
            try:
                await self._subscribe(site)
            except SiteCallError as exc:
                log.debug("%s; reconnecting", exc)
            await asyncio.sleep(_RETRY_S)

    async def _subscribe(self, site: SiteState) -> None:
        """One load stream, until it breaks, its cache events show a gap (the next stream's
        snapshot repairs the index), or what the site's info says about caching changes."""
        events = wants_cache_events(site)
        if events:
            site.prefix.follow_events()
        async for report in site.client.load_reports(self._interval_ms, cache_events=events):
            site.apply_report(report)
            batch = report.cache_events if events else None
            if batch is not None and site.prefix.apply(batch) is ApplyOutcome.GAP:
                log.info("site %s: cache events out of sequence; re-subscribing", site.name)
                return
            if wants_cache_events(site) != events:
                return

    def stale(self, site: SiteState, now: float | None = None) -> bool:
        """A site that reported before and has been silent too long (reports stalled)."""
        if site.report is None:
            return False
        return (now if now is not None else time.monotonic()) - site.report_at > self._stale_after_s
