"""Everything the gateway holds while it runs, started and stopped in one place."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admin_dashboard import Dashboard
from gateway.batches import BatchService
from gateway.chat import ChatService
from gateway.chat_templates import ChatTemplates
from gateway.completions import CompletionService
from gateway.db.migrate import upgrade
from gateway.db.session import create_engine, create_sessionmaker
from gateway.drain import SiteDrainer
from gateway.idempotency import Idempotency
from gateway.load_sampler import LoadSampler
from gateway.metrics import GatewayMetrics
from gateway.offload import OffloadCoordinator
from gateway.predictor_lifecycle import follow_registry, start_predictors
from gateway.routing.policy import build_policy
from gateway.services.admin_sessions import AdminSessionStore
from gateway.services.idempotency import IdempotencyStore
from gateway.services.predictor_registry import PredictorRegistry
from gateway.services.request_log import RequestLog
from gateway.services.site_store import sync_sites
from gateway.settings import GatewaySettings
from gateway.sites.client import SiteClient
from gateway.sites.config import FederationConfig, load_federation
from gateway.sites.health import HealthMonitor
from gateway.sites.load_reports import LoadReportListener
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.sites.tls import load_site_tls
from gateway.tenancy.admission import Tenancy
from gateway.tenancy.keys import KeyService
from gateway.tenancy.limiter import SlidingWindowLimiter
from gateway.tokenize_pool import TokenizePool
from gateway.tokenizers import ModelTokenizers

log = logging.getLogger(__name__)


def _ensure_sqlite_dir(database_url: str) -> None:
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)


@dataclass(slots=True)
class GatewayRuntime:
    settings: GatewaySettings
    federation: FederationConfig
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    registry: SiteRegistry
    tokenizers: ModelTokenizers
    completions: CompletionService
    monitor: HealthMonitor
    chat: ChatService
    offload: OffloadCoordinator | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # This gateway's Prometheus registry (its own, not the process-global one): GET /metrics.
    metrics: GatewayMetrics = field(init=False)
    batches: BatchService = field(init=False)
    # The admin dashboard's views (its history is written by the load-sampler task).
    dashboard: Dashboard = field(init=False)
    # API keys and their limits (the limiter's windows live in this process only).
    tenancy: Tenancy = field(init=False)
    # Stored results of requests sent with an Idempotency-Key (gateway/idempotency.py).
    idempotency: Idempotency = field(init=False)
    # Operators' drains of sites (gateway/drain.py).
    drainer: SiteDrainer = field(init=False)
    # The dashboard's sign-ins, revocable on every gateway of the database (api/admin_auth.py).
    admin_sessions: AdminSessionStore = field(init=False)
    # Where client prompts are tokenized, off the event loop.
    tokenize_pool: TokenizePool = field(init=False)

    @classmethod
    async def start(cls, settings: GatewaySettings) -> GatewayRuntime:
        federation = load_federation(settings.federation_file)
        site_tls = load_site_tls(settings)  # unreadable certificate files stop the start
        tokenizers = ModelTokenizers(federation.models)
        chat_templates = ChatTemplates.load(federation.models)  # a bad template stops the start
        if settings.auto_migrate:
            _ensure_sqlite_dir(settings.database_url)
            await asyncio.to_thread(upgrade, settings.database_url)
        engine = create_engine(settings.database_url)
        sessions = create_sessionmaker(engine)
        site_ids = await sync_sites(sessions, federation.sites)
        registry = SiteRegistry(
            SiteState(
                config=site,
                site_id=site_ids[site.name],
                client=SiteClient(
                    site.name,
                    site.endpoint,
                    settings.connect_timeout_s,
                    site_tls,
                    site.tls_server_name,
                ),
            )
            for site in federation.sites
        )
        listener = LoadReportListener(
            registry, settings.load_report_interval_ms, settings.load_report_stale_s
        )
        monitor = HealthMonitor(
            registry, tokenizers.fingerprints, settings.health_interval_s, listener.stale
        )
        await monitor.check_once()  # route from the first request on, not after one interval
        predictor_registry = PredictorRegistry(sessions)
        predictor = await start_predictors(settings, federation.models, predictor_registry)
        predictor.start()
        metrics = GatewayMetrics()
        metrics.watch_sites(registry.all)
        predictor.metrics = metrics
        completions = CompletionService(
            settings,
            registry,
            tokenizers,
            build_policy(
                settings.routing_policy,
                settings.site_max_queued_requests or None,
                settings.site_max_queued_tokens or None,
            ),
            RequestLog(sessions),
            predictor,
            metrics,
        )
        chat = ChatService(chat_templates, tokenizers, completions)
        runtime = cls(
            settings, federation, engine, sessions, registry, tokenizers, completions, monitor, chat
        )
        runtime.metrics = metrics
        runtime._tasks.append(asyncio.create_task(monitor.run(), name="site-health"))
        runtime._tasks.append(asyncio.create_task(listener.run(), name="load-reports"))
        runtime.dashboard = Dashboard(settings, registry, sessions)
        sampler = LoadSampler(
            registry,
            sessions,
            interval_s=settings.load_sample_interval_s,
            retention_s=settings.load_history_retention_h * 3600,
            request_timeout_s=settings.request_timeout_s,
        )
        runtime._tasks.append(asyncio.create_task(sampler.run(), name="load-sampler"))
        if settings.offload_enabled:
            runtime.offload = OffloadCoordinator(
                registry, settings.offload_interval_s, settings.offload_transfer_cost_s, metrics
            )
            runtime._tasks.append(asyncio.create_task(runtime.offload.run(), name="offload"))
        runtime._tasks.append(
            asyncio.create_task(
                follow_registry(
                    predictor,
                    predictor_registry,
                    [model.name for model in federation.models],
                    settings.predictor_poll_s,
                ),
                name="predictor-registry",
            )
        )
        runtime.tenancy = Tenancy(
            KeyService(sessions), SlidingWindowLimiter(), settings.require_api_keys
        )
        runtime.idempotency = Idempotency(
            IdempotencyStore(sessions), settings.idempotency_ttl_s, settings.request_timeout_s
        )
        runtime.admin_sessions = AdminSessionStore(sessions)
        runtime.tokenize_pool = TokenizePool(settings.tokenize_threads)
        runtime.drainer = SiteDrainer(registry, settings.offload_interval_s)
        runtime._tasks.append(asyncio.create_task(runtime.drainer.run(), name="site-drain"))
        runtime.batches = BatchService.build(settings, sessions, completions, registry)
        runtime.batches.runner.start()  # resumes the batches left unfinished
        healthy = sum(site.healthy for site in registry.all())
        log.info("gateway up: %d/%d sites healthy", healthy, len(registry.all()))
        return runtime

    async def stop(self) -> None:
        await self.batches.runner.stop()  # first: its items wait on the predictor and sites
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.completions.predictors.stop()
        await self.completions.drain()
        await self.idempotency.drain()
        self.tokenize_pool.close()
        await self.registry.close()
        await self.engine.dispose()
