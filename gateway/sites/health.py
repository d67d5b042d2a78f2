"""Polls every site's gRPC health and info, so routing only ever reads in-memory state.

A check that hears something definite acts at once: a site that refuses the connection, says
NOT_SERVING, or serves another model or tokenizer is unhealthy from that check on. A check that
hears nothing within the deadline does not: an overloaded site (thousands of requests queued)
or a gateway whose own event loop runs late under that load misses a 2 s deadline now and then,
and marking every such site down turned a slow federation into one refusing everything (503,
"healthy: 0") while the sites were alive. A healthy site goes down after
`failures_to_down` checks in a row without an answer (GATEWAY_HEALTH_FAILURES_TO_DOWN); one
answered check makes a site healthy again. Refusing work because a site is busy is the queue
bounds' job (gateway/routing/filters.py), not health's.

Stalled load reports are logged, not acted on: the health check already tells a hung site (it
stops answering) from a busy one, and a site's load is the larger of its last report and this
gateway's own ledger (gateway/sites/registry.py), so a silent site never looks idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from gateway.federation import ModelTask
from gateway.sites.interface import HealthAnswer, SiteCallError, SiteInfoView
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
        failures_to_down: int = 1,
    ) -> None:
        """`tasks`: each model's task in the federation file (absent: generate).
        `failures_to_down`: unanswered checks in a row that mark a healthy site down."""
        if failures_to_down < 1:
            raise ValueError(f"failures_to_down must be >= 1, got {failures_to_down}")
        self._registry = registry
        self._fingerprints = tokenizer_fingerprints
        self._tasks = tasks or {}
        self._interval_s = interval_s
        self._is_stale = is_stale or (lambda _site: False)
        self._failures_to_down = failures_to_down
        self._stale_logged: set[str] = set()

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
        answer = await site.client.check_health()
        if answer is HealthAnswer.REFUSED:
            site.mark_unhealthy("health check refused (nothing answers at its address)")
        elif answer is HealthAnswer.NOT_SERVING:
            site.mark_unhealthy("health check says NOT_SERVING")
        elif answer is HealthAnswer.NO_ANSWER:
            self._unanswered(site, "health check unanswered within the deadline")
        else:
            # The check is the cheapest call a site answers: its duration is the round trip.
            site.rtt.observe(time.perf_counter() - started)
            adapter_changes = site.adapter_changes
            try:
                info = await site.client.info()
            except SiteCallError as exc:
                # It answered its health check just now: alive, so not definite.
                self._unanswered(site, str(exc))
            else:
                problem = self._mismatch(site, info)
                if problem:
                    site.mark_unhealthy(problem)
                else:
                    site.mark_healthy(info, adapter_changes)
                    self._log_stale(site)
        if was_healthy != site.healthy or (first_check and not site.healthy):
            level = logging.INFO if site.healthy else logging.WARNING
            log.log(
                level,
                "site %s is now %s%s",
                site.name,
                "healthy" if site.healthy else "unhealthy",
                "" if site.healthy else f": {site.last_error}",
            )

    def _unanswered(self, site: SiteState, reason: str) -> None:
        """A check without a definite answer: a healthy site stays so until
        `failures_to_down` of them in a row; one not healthy yet stays down."""
        site.unanswered_checks += 1
        count = site.unanswered_checks
        if not site.healthy or count >= self._failures_to_down:
            site.mark_unhealthy(f"{reason} ({count} check(s) in a row)")
            return
        site.last_error = reason
        log.warning(
            "site %s: %s (%d of %d before it is marked unhealthy)",
            site.name,
            reason,
            count,
            self._failures_to_down,
        )

    def _log_stale(self, site: SiteState) -> None:
        stale = self._is_stale(site)
        if stale and site.name not in self._stale_logged:
            self._stale_logged.add(site.name)
            log.warning(
                "site %s: its load reports stopped arriving; it stays routable on its last "
                "report and this gateway's ledger while its health checks pass",
                site.name,
            )
        elif not stale:
            self._stale_logged.discard(site.name)

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
