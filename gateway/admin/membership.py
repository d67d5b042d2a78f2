"""Sites joining and leaving at run time: an operator's admin API, the scaling controller's
actuators (gateway/scaling/).

A site that joins gets its row in the sites table (enabled), a client of its kind, one health
check at once (routable from the next decision when it answers: its KV room and batch slots come
from its info, its step time and prefill rate from its same-model peers until its own reports
measure them, gateway/sites/registry.py), its load-report stream (and, for a vLLM site that
names them, its KV events) followed.

A site leaves by draining: it takes nothing new, its queued requests move to the model's other
sites (gateway/admin/drain.py) and its running ones finish where they are. Once neither this
gateway nor the site's own reports show work there (or `leave_timeout_s` passed: what still
runs then continues on another site when the site goes, as on any site failure), its streams are
stopped, it leaves the registry, its client is closed and its row is disabled. Nothing accepted
is lost. Every join and leave is a scaling event in the database.

Like drains, membership lives in this gateway's memory: with several gateways, an operator joins
a site on each (the federation file lists the sites every gateway starts with), and under
Kubernetes each gateway discovers the sites itself (gateway/scaling/kubernetes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admin.drain import SiteDrainer
from gateway.errors import Conflict, invalid_request
from gateway.federation import FederationConfigError, ModelConfig, SiteConfig, parse_site
from gateway.metrics import GatewayMetrics
from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.sites.health import HealthMonitor
from gateway.sites.interface import SiteClient
from gateway.sites.load_reports import LoadReportListener
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.sites.vllm_kv_events import kv_event_followers
from gateway.stores.scaling_events import (
    NewScalingEvent,
    ScalingEventRow,
    record_scaling_event,
    scaling_events_since,
)
from gateway.stores.site_store import disable_site, enable_site

log = logging.getLogger(__name__)
_POLL_S = 0.2

NewClient = Callable[[SiteConfig], SiteClient]


@dataclass(frozen=True, slots=True)
class MemberView:
    """A site as the admin API answers about its membership."""

    site: str
    model: str
    origin: str
    healthy: bool
    draining: bool
    # Leaving: draining now and removed once idle.
    leaving: bool
    in_flight: int


def serving_sites(registry: SiteRegistry, model: str) -> int:
    """The model's sites that take new work (healthy, not draining)."""
    return sum(s.model == model and s.healthy and not s.draining for s in registry.all())


def site_idle(site: SiteState, since: float) -> bool:
    """Nothing of this gateway's runs there, and the site's own last report, made after `since`
    (monotonic), shows nothing queued or running (other gateways' work included); a site that
    stopped reporting or answering has nothing more to give back."""
    if site.in_flight > 0:
        return False
    report = site.report
    if report is None or not site.healthy:
        return True
    return site.report_at > since and report.queued_requests + report.running_requests == 0


class SiteMembership:
    def __init__(
        self,
        registry: SiteRegistry,
        sessions: async_sessionmaker[AsyncSession],
        watchers: tuple[HealthMonitor, LoadReportListener],
        drainer: SiteDrainer,
        new_client: NewClient,
        prefix_blocks: int,
        models: tuple[ModelConfig, ...],
        base_dir: Path,
        metrics: GatewayMetrics,
        leave_timeout_s: float = 600.0,
    ) -> None:
        self._registry = registry
        self._sessions = sessions
        self._monitor, self._listener = watchers
        self._drainer = drainer
        self._new_client = new_client
        self._prefix_blocks = prefix_blocks
        self._models = models
        self._base_dir = base_dir
        self._metrics = metrics
        self._leave_timeout_s = leave_timeout_s
        self._leaving: dict[str, asyncio.Task[None]] = {}
        self._followers: dict[str, list[asyncio.Task[None]]] = {}

    def parse(self, body: bytes) -> SiteConfig:
        """A site entry as the federation file writes it; 400 naming what is wrong."""
        try:
            return parse_site(body, self._base_dir, self._models)
        except FederationConfigError as exc:
            raise invalid_request(str(exc), param="site", code="invalid_site") from exc

    async def join(self, config: SiteConfig, origin: str, note: str = "") -> SiteState:
        """Registers the site and starts watching it; 409 when the name is taken (a site that
        is still leaving included). `note` goes into its join event."""
        if self._registry.get(config.name) is not None:
            raise Conflict(
                f"a site named {config.name!r} is already registered", param="name",
                code="site_exists",
            )  # fmt: skip
        site_id = await enable_site(self._sessions, config)
        if self._registry.get(config.name) is not None:  # joined while the row was written
            raise Conflict(f"a site named {config.name!r} is already registered", param="name")
        site = SiteState(
            config=config,
            site_id=site_id,
            client=self._new_client(config),
            prefix=SitePrefix(self._prefix_blocks),
            origin=origin,
            joined_at=time.monotonic(),
        )
        self._registry.add(site)
        await self._monitor.check(site)
        self._listener.follow(site)
        self._follow_kv_events(site)
        self._metrics.site_changes.labels("join").inc()
        log.info("site %s (%s) joined: %s", site.name, origin, "healthy" if site.healthy else
                 f"not healthy yet ({site.last_error})")  # fmt: skip
        await self._record(site, "join", origin, f"joined ({origin}){note and ': ' + note}")
        return site

    def _follow_kv_events(self, site: SiteState) -> None:
        works: dict[str, Coroutine[Any, Any, None]] = kv_event_followers([site])
        self._followers[site.name] = [
            asyncio.create_task(work, name=name) for name, work in works.items()
        ]

    def leave(self, name: str, actor: str, reason: str = "") -> asyncio.Task[None] | None:
        """Starts the site's leave (drain, wait until idle, remove); the task that ends once it
        is gone (the same one for a site already leaving). None for an unknown site."""
        if name in self._leaving:
            return self._leaving[name]
        site = self._registry.get(name)
        if site is None:
            return None
        site.draining = True  # from this moment on: nothing new is routed there
        task = asyncio.create_task(self._leave(site, actor, reason), name=f"leave-{name}")
        self._leaving[name] = task
        task.add_done_callback(lambda _: self._leaving.pop(name, None))
        return task

    def leaving(self) -> list[str]:
        return sorted(self._leaving)

    def site(self, name: str) -> SiteState | None:
        return self._registry.get(name)

    async def events(self, since: datetime, limit: int) -> list[ScalingEventRow]:
        """The latest scaling events (joins, leaves, the controller's decisions)."""
        return await scaling_events_since(self._sessions, since, limit)

    def view(self, site: SiteState) -> MemberView:
        return MemberView(
            site=site.name,
            model=site.model,
            origin=site.origin,
            healthy=site.healthy,
            draining=site.draining,
            leaving=site.name in self._leaving,
            in_flight=site.in_flight,
        )

    async def _leave(self, site: SiteState, actor: str, reason: str) -> None:
        started = time.monotonic()
        await self._drainer.drain(site.name)
        await self._record(site, "drain", actor, reason or f"draining ({actor})")
        while not site_idle(site, started):
            if time.monotonic() - started > self._leave_timeout_s:
                log.warning(
                    "site %s still has %d request(s) after %.0f s of draining: it leaves now "
                    "(they continue on other sites)", site.name, site.in_flight,
                    self._leave_timeout_s,
                )  # fmt: skip
                break
            await asyncio.sleep(_POLL_S)
        await self._listener.unfollow(site.name)
        for task in self._followers.pop(site.name, []):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._registry.remove(site.name)
        await site.client.close()
        await disable_site(self._sessions, site.name)
        self._metrics.site_changes.labels("leave").inc()
        log.info("site %s left after %.1f s of draining", site.name, time.monotonic() - started)
        await self._record(site, "leave", actor, f"left after draining ({actor})")

    async def _record(self, site: SiteState, action: str, actor: str, reason: str) -> None:
        serving = serving_sites(self._registry, site.model)
        event = NewScalingEvent(site.model, action, actor, serving, serving, reason, site.name)
        try:
            await record_scaling_event(self._sessions, event)
        except Exception:  # the site joined or left all the same; the log keeps what happened
            log.exception("could not record the %s of site %s", action, site.name)

    async def close(self) -> None:
        """Stops leaves under way (the gateway stops: its sites go with it) and followers."""
        for task in [*self._leaving.values(), *(t for ts in self._followers.values() for t in ts)]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
