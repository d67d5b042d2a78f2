"""Polls every site's gRPC health and info, so routing only ever reads in-memory state."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from gateway.federation import ModelTask
from gateway.sites.interface import SiteCallError, SiteInfoView
from gateway.sites.registry import SiteRegistry, SiteState

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        registry: SiteRegistry,
        tokenizer_fingerprints: Mapping[str, str],
        interval_s: float,
        is_stale: Callable[[SiteState], bool] | None = None,
        tasks: Mapping[str, ModelTask] | None = None,
    ) -> None:
        """`tasks`: each model's task in the federation file (absent: generate)."""
        self._registry = registry
        self._fingerprints = tokenizer_fingerprints
        self._tasks = tasks or {}
        self._interval_s = interval_s
        self._is_stale = is_stale or (lambda _site: False)

    async def check_once(self) -> None:
        await asyncio.gather(*(self._check(site) for site in self._registry.all()))

    async def check(self, site: SiteState) -> None:
        """One check of one site now (a site that joins is routable at once, not an interval
        later)."""
        await self._check(site)

    async def run(self) -> None:
        """Checks every interval, the first one interval after the start's own `check_once`: a
        second check at once told nothing new, and made the first interval shorter than the
        operator's setting (a site killed right after the start was marked down before any
        request could try it, so the dispatch path's failover went untested: a flaky test)."""
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_once()

    async def _check(self, site: SiteState) -> None:
        was_healthy = site.healthy
        # A site that is wrong from the start (down, refusing our TLS) is said so once, too.
        first_check = site.checked_at == 0.0
        started = time.perf_counter()
        if not await site.client.check_health():
            site.mark_unhealthy("health check failed (site down or not serving)")
        else:
            # The check is the cheapest call a site answers: its duration is the round trip.
            site.rtt.observe(time.perf_counter() - started)
            try:
                info = await site.client.info()
            except SiteCallError as exc:
                site.mark_unhealthy(str(exc))
            else:
                problem = self._mismatch(site, info)
                if problem is None and self._is_stale(site):
                    problem = "its load reports stopped arriving"
                if problem:
                    site.mark_unhealthy(problem)
                else:
                    site.mark_healthy(info)
        if was_healthy != site.healthy or (first_check and not site.healthy):
            level = logging.INFO if site.healthy else logging.WARNING
            log.log(
                level,
                "site %s is now %s%s",
                site.name,
                "healthy" if site.healthy else "unhealthy",
                "" if site.healthy else f": {site.last_error}",
            )

    def _mismatch(self, site: SiteState, info: SiteInfoView) -> str | None:
        model = info.model
        if model != site.config.model:
            return f"serves model {model!r}, configured for {site.config.model!r}"
        expected = self._fingerprints.get(model)
        if expected is not None and info.tokenizer_fingerprint != expected:
            return "its tokenizer differs from the gateway's tokenizer for this model"
        task = self._tasks.get(model, "generate")
        if info.task != task:
            return (
                f"its model {model!r} has task {info.task!r} there, but task {task!r} in the "
                "federation file"
            )
        return None
