"""The admin dashboard's history: every interval, one load sample per site into the database.

A sample is the gateway's live view of the site at that instant (its last load report and
health) plus the requests that finished on it since the previous sample (how many, and their
time to first token and end-to-end latency). Rows older than the retention are deleted here too,
so the table stays bounded without another job.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.exc import SQLAlchemyError

from gateway.db.models import utcnow
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.load_history import (
    NewLoadSample,
    Sessions,
    delete_samples_before,
    roll_up,
    write_samples,
)
from gateway.stores.request_history import FinishedRequest, finished_requests

log = logging.getLogger(__name__)
_PRUNE_EVERY_S = 60.0
# A request's finished row is written after its finished_at (the outcome write runs after the
# stream ends, and waits in the outcome backlog while the database is down), so each sample looks
# back this far for rows written late and counts those it has not counted yet.
LATE_WRITE_MARGIN = timedelta(seconds=60)


@dataclass(frozen=True, slots=True)
class LiveLoad:
    """A site's load as its last report gives it; zeros until it has reported."""

    queued_tokens: int
    running_tokens: int
    predicted_remaining_tokens: int
    queued_requests: int
    running_requests: int

    @property
    def token_load(self) -> int:
        return self.queued_tokens + self.running_tokens + self.predicted_remaining_tokens

    @classmethod
    def of(cls, site: SiteState) -> LiveLoad:
        report = site.report
        if report is None:
            return cls(0, 0, 0, 0, 0)
        return cls(
            report.queued_prompt_tokens,
            report.running_tokens,
            report.predicted_remaining_tokens,
            report.queued_requests,
            report.running_requests,
        )


def _ms(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and median in milliseconds (None for no values)."""
    if not values:
        return None, None
    return statistics.fmean(values) * 1000.0, statistics.median(values) * 1000.0


def build_sample(site: SiteState, finished: Sequence[FinishedRequest]) -> NewLoadSample:
    load = LiveLoad.of(site)
    ttft_mean, ttft_p50 = _ms([f.ttft_s for f in finished if f.ttft_s is not None])
    e2e_mean, e2e_p50 = _ms([f.e2e_s for f in finished])
    return NewLoadSample(
        site_id=site.site_id,
        queued_tokens=load.queued_tokens,
        running_tokens=load.running_tokens,
        predicted_remaining_tokens=load.predicted_remaining_tokens,
        queued_requests=load.queued_requests,
        running_requests=load.running_requests,
        completed_requests=len(finished),
        ttft_mean_ms=ttft_mean,
        ttft_p50_ms=ttft_p50,
        e2e_mean_ms=e2e_mean,
        e2e_p50_ms=e2e_p50,
        healthy=site.healthy,
    )


class LoadSampler:
    def __init__(
        self,
        registry: SiteRegistry,
        sessions: Sessions,
        *,
        interval_s: float,
        retention_s: float,
        request_timeout_s: float,
    ) -> None:
        self._registry = registry
        self._sessions = sessions
        self._interval_s = interval_s
        self._retention = timedelta(seconds=retention_s)
        self._max_request_age = timedelta(seconds=request_timeout_s)
        self._last_prune = float("-inf")
        # Requests counted in a sample whose finish still lies within the look-back margin.
        self._counted: dict[str, datetime] = {}
        self._floor: datetime | None = None

    async def _newly_finished(self, since: datetime, now: datetime) -> list[FinishedRequest]:
        """Requests finished in (since, now], plus those finished within the margin before
        `since` whose rows were written too late for earlier samples; never one twice, and never
        one that finished before the first sample's start (a previous process counted those)."""
        if self._floor is None:
            self._floor = since
        lower = max(since - LATE_WRITE_MARGIN, self._floor)
        finished = await finished_requests(self._sessions, lower, now, self._max_request_age)
        fresh = [f for f in finished if f.request_id not in self._counted]
        self._counted.update((f.request_id, f.finished_at) for f in fresh)
        horizon = now - LATE_WRITE_MARGIN
        self._counted = {k: at for k, at in self._counted.items() if at > horizon}
        return fresh

    async def sample_once(self, since: datetime) -> datetime:
        """Writes one sample per site covering (since, now] (and late rows, see above);
        returns now."""
        now = utcnow()
        by_site: defaultdict[int, list[FinishedRequest]] = defaultdict(list)
        for request in await self._newly_finished(since, now):
            by_site[request.site_id].append(request)
        samples = [build_sample(site, by_site[site.site_id]) for site in self._registry.all()]
        await write_samples(self._sessions, now, samples)
        await roll_up(self._sessions, now)  # a no-op until a 5-minute period is over
        return now

    async def prune(self) -> int:
        return await delete_samples_before(self._sessions, utcnow() - self._retention)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        since = utcnow()
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                since = await self.sample_once(since)
                if loop.time() - self._last_prune >= _PRUNE_EVERY_S:
                    self._last_prune = loop.time()
                    deleted = await self.prune()
                    if deleted:
                        log.info("load history: deleted %d samples past retention", deleted)
            except (SQLAlchemyError, OSError) as exc:
                # A database hiccup costs one sample, never the sampler; the next one covers
                # the requests finished meanwhile since `since` did not move.
                log.warning("load sample not written: %s", exc)
