"""What the admin dashboard shows: the live overview, and history read back from the database.

The overview joins the gateway's live view of each site (load report, ledger, health) with the
requests completed over the last minute. It is built at most once a second and shared, so every
open dashboard (each one polling through SSE) costs the database one small query per second.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta

from gateway.admin import series as admin_series
from gateway.admin.load_sampler import LiveLoad
from gateway.admin.views import (
    CloudNow,
    Drift,
    History,
    Offloads,
    OffloadView,
    Overview,
    Policy,
    SiteDetail,
    SiteNow,
)
from gateway.db.models import utcnow
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.adapter_load import AdapterLoad, adapter_load
from gateway.stores.load_history import (
    Sessions,
    Window,
    load_buckets,
    oldest_history,
    site_directory,
)
from gateway.stores.request_history import (
    RecentStats,
    drift_buckets,
    offloads_since,
    recent_stats,
)

RECENT_S = 60
DEFAULT_POINTS = 288
MAX_POINTS = 2000
_OVERVIEW_TTL_S = 1.0


class WindowError(ValueError):
    """A history window or step out of bounds; the message says which."""


def _ms(total_s: float, count: int) -> float | None:
    return round(total_s / count * 1000.0, 1) if count else None


def _site_now(site: SiteState, stats: RecentStats | None) -> SiteNow:
    load = LiveLoad.of(site)
    stats = stats or RecentStats(0, 0.0, 0, 0.0)
    return SiteNow(
        name=site.name,
        cloud=site.config.cloud,
        region=site.config.region,
        model=site.model,
        healthy=site.healthy,
        last_error=site.last_error,
        queued_tokens=load.queued_tokens,
        running_tokens=load.running_tokens,
        predicted_remaining_tokens=load.predicted_remaining_tokens,
        token_load=load.token_load,
        queued_requests=load.queued_requests,
        running_requests=load.running_requests,
        in_flight=site.in_flight,
        ledger_tokens=site.ledger_tokens,
        completed_recent=stats.completed,
        requests_per_min=round(stats.completed * 60.0 / RECENT_S, 2),
        ttft_ms=_ms(stats.ttft_s_sum, stats.ttft_count),
        e2e_ms=_ms(stats.e2e_s_sum, stats.completed),
        draining=site.draining,
        kind=site.kind,
        can_release_queued=site.can_release_queued,
        prefix_cache_hit_rate=_hit_rate(site),
        adapters_on_device=tuple(sorted(site.adapter_residency.on_device)),
        adapters_in_host=tuple(sorted(site.adapter_residency.in_host)),
    )


def _hit_rate(site: SiteState) -> float | None:
    report = site.report
    if report is None or not report.prefix_cache_queries:
        return None
    return round(report.prefix_cache_hits / report.prefix_cache_queries, 3)


def _clouds(sites: list[SiteState], stats: dict[int, RecentStats]) -> list[CloudNow]:
    by_cloud: defaultdict[str, list[SiteState]] = defaultdict(list)
    for site in sites:
        by_cloud[site.config.cloud].append(site)
    clouds = []
    for cloud, members in sorted(by_cloud.items()):
        loads = [LiveLoad.of(s) for s in members]
        recent = [stats[s.site_id] for s in members if s.site_id in stats]
        completed = sum(r.completed for r in recent)
        ttft_count = sum(r.ttft_count for r in recent)
        clouds.append(
            CloudNow(
                cloud=cloud,
                sites=len(members),
                healthy_sites=sum(s.healthy for s in members),
                queued_tokens=sum(x.queued_tokens for x in loads),
                running_tokens=sum(x.running_tokens for x in loads),
                predicted_remaining_tokens=sum(x.predicted_remaining_tokens for x in loads),
                token_load=sum(x.token_load for x in loads),
                queued_requests=sum(x.queued_requests for x in loads),
                running_requests=sum(x.running_requests for x in loads),
                completed_recent=completed,
                requests_per_min=round(completed * 60.0 / RECENT_S, 2),
                ttft_ms=_ms(sum(r.ttft_s_sum for r in recent), ttft_count),
                e2e_ms=_ms(sum(r.e2e_s_sum for r in recent), completed),
            )
        )
    return clouds


class Dashboard:
    def __init__(
        self, settings: GatewaySettings, registry: SiteRegistry, sessions: Sessions
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._sessions = sessions
        self._lock = asyncio.Lock()
        self._overview: Overview | None = None
        self._overview_at = float("-inf")

    def _sites(self) -> list[SiteState]:
        return sorted(self._registry.all(), key=lambda s: (s.config.cloud, s.config.region, s.name))

    async def overview(self) -> Overview:
        async with self._lock:
            if time.monotonic() - self._overview_at >= _OVERVIEW_TTL_S or self._overview is None:
                self._overview = await self._build_overview()
                self._overview_at = time.monotonic()
            return self._overview

    async def _build_overview(self) -> Overview:
        now = utcnow()
        since = now - timedelta(seconds=RECENT_S)
        max_age = timedelta(seconds=self._settings.limits.request_timeout_s)
        stats = await recent_stats(self._sessions, since, now, max_age)
        offloads, _ = await offloads_since(self._sessions, since, limit=0)
        oldest = await oldest_history(self._sessions)
        sites = self._sites()
        return Overview(
            at=round(now.timestamp(), 3),
            recent_s=RECENT_S,
            sample_interval_s=self._settings.history.load_sample_interval_s,
            policy=Policy(self._settings.routing.policy, self._settings.offload.enabled),
            clouds=_clouds(sites, stats),
            sites=[_site_now(s, stats.get(s.site_id)) for s in sites],
            offloads_recent=offloads,
            history_since=round(oldest.timestamp(), 3) if oldest is not None else None,
        )

    def default_step(self, window_s: int) -> int:
        """About DEFAULT_POINTS buckets over the window, each at least two sampler intervals
        wide. The sampler writes a sample every interval plus the time the write takes, on no
        fixed grid: a bucket one interval wide now and then gets none, and a bucket narrower
        than that (15 minutes at 288 points is 4 s; samples come every 10 s) mostly gets none,
        leaving every point alone between gaps, where a chart draws no line at all."""
        fewest = math.ceil(2 * self._settings.history.load_sample_interval_s)
        return max(math.ceil(window_s / DEFAULT_POINTS), fewest, 1)

    def window(self, window_s: int, step_s: int | None = None) -> Window:
        """The buckets covering the last `window_s` seconds, aligned to multiples of the step so
        that consecutive loads agree on bucket boundaries."""
        retention_s = self._settings.history.load_history_retention_h * 3600
        if not 60 <= window_s <= max(retention_s, 60):
            raise WindowError(f"window_s must be between 60 and {retention_s:.0f} (retention)")
        step = step_s if step_s is not None else self.default_step(window_s)
        # A step longer than the window would put the window's end past datetime's range.
        if not 1 <= step <= window_s:
            raise WindowError("step_s must be between 1 and window_s")
        now = time.time()
        start = math.floor((now - window_s) / step) * step
        points = math.ceil((now - start) / step)
        if points > MAX_POINTS:
            raise WindowError(f"window_s / step_s gives {points} points; at most {MAX_POINTS}")
        return Window(int(start), step, points)

    async def history(self, window: Window, site: str | None = None) -> History | None:
        """Per-cloud series, or one site's; None when the site is unknown."""
        directory = await site_directory(self._sessions)
        if site is None:
            buckets = await load_buckets(self._sessions, window)
            series = admin_series.cloud_series(buckets, directory, window)
        else:
            ref = next((r for r in directory.values() if r.name == site), None)
            if ref is None:
                return None
            buckets = await load_buckets(self._sessions, window, ref.site_id)
            series = [admin_series.site_series(buckets, ref, window)]
        return History(window.start_s, window.step_s, window.points, series)

    async def drift(
        self, window: Window, site: str | None = None, series: bool = True
    ) -> Drift | None:
        directory = await site_directory(self._sessions)
        site_id = None
        if site is not None:
            site_id = next((i for i, r in directory.items() if r.name == site), None)
            if site_id is None:
                return None
        buckets = await drift_buckets(self._sessions, window, site_id, bucketed=series)
        return admin_series.drift(buckets, directory, window, series)

    async def offloads(self, window_s: int, limit: int, site: str | None = None) -> Offloads:
        directory = await site_directory(self._sessions)
        names = {i: r.name for i, r in directory.items()}
        site_id = next((i for i, n in names.items() if n == site), -1) if site else None
        since = utcnow() - timedelta(seconds=window_s)
        total, rows = await offloads_since(self._sessions, since, limit, site_id)
        events = [
            OffloadView(
                at=round(row.at.timestamp(), 3),
                request_id=row.request_id,
                from_site=names.get(row.from_site_id) if row.from_site_id else None,
                to_site=names.get(row.to_site_id) if row.to_site_id else None,
            )
            for row in rows
        ]
        return Offloads(round(since.timestamp(), 3), total, events)

    async def adapter_load(self, window_s: int) -> list[AdapterLoad]:
        """Requests and tokens per LoRA adapter over the last window_s seconds."""
        return await adapter_load(self._sessions, utcnow() - timedelta(seconds=window_s))

    async def site_detail(self, name: str, window: Window, limit: int) -> SiteDetail | None:
        state = self._registry.get(name)
        if state is None:
            return None
        overview = await self.overview()
        now = next(s for s in overview.sites if s.name == name)
        history = await self.history(window, name)
        drift = await self.drift(window, name)
        if history is None or drift is None:
            return None
        window_s = int(datetime.now(UTC).timestamp()) - window.start_s
        offloads = await self.offloads(window_s, limit, name)
        return SiteDetail(now, history, drift, offloads)
