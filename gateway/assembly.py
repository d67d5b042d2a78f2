"""The gateway's composition root: every long-lived part and background task, built, started and
stopped in one place."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.admin.adapters import AdapterAdmin
from gateway.admin.dashboard import Dashboard
from gateway.admin.drain import SiteDrainer
from gateway.admin.load_sampler import LoadSampler
from gateway.admin.membership import SiteMembership
from gateway.admin.offload import OffloadCoordinator
from gateway.admin.predictor_health import PredictorHealth
from gateway.admin.readiness import Readiness
from gateway.admin.retrain_worker import RetrainWorker, missing_training_stack
from gateway.admin.retraining import Retraining
from gateway.api.openai_errors import http_status
from gateway.batches.service import BatchService
from gateway.chat.service import ChatService
from gateway.chat.templates import ChatTemplates
from gateway.db.migrate import upgrade
from gateway.db.session import create_counter_engine, create_engine, create_sessionmaker
from gateway.embeddings.prepare import EmbeddingPreparer
from gateway.embeddings.route import EmbeddingRouter
from gateway.embeddings.service import EmbeddingService
from gateway.federation import FederationConfig, ModelTask, load_federation
from gateway.files.service import FileService
from gateway.fine_tuning.service import FineTuningService
from gateway.idempotency import Idempotency
from gateway.metrics import GatewayMetrics
from gateway.model_catalogue import AdapterCatalogue
from gateway.prediction.lifecycle import follow_registry, start_predictors
from gateway.request_path.service import CompletionService
from gateway.responses.service import ResponsesService
from gateway.routing.policy import build_policy
from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.scaling.build import build_controller
from gateway.scaling.config import load_scaling
from gateway.scaling.controller import ScalingController
from gateway.settings import GatewaySettings
from gateway.sites.chunk_governor import ChunkGovernor, govern
from gateway.sites.factory import site_client
from gateway.sites.grpc_generate_stream import ChunkPacer
from gateway.sites.health import HealthMonitor
from gateway.sites.load_reports import LoadReportListener
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.sites.tls import load_site_tls
from gateway.sites.vllm_kv_events import kv_event_followers
from gateway.stores.adapter_owners import AdapterOwnerStore
from gateway.stores.admin_sessions import AdminSessionStore
from gateway.stores.file_store import FileStore
from gateway.stores.idempotency_records import IdempotencyStore
from gateway.stores.key_limit_store import KeyLimitStore
from gateway.stores.login_failures import LoginFailureStore
from gateway.stores.predictor_registry import PredictorRegistry
from gateway.stores.request_log import RequestLog
from gateway.stores.response_store import ResponseStore
from gateway.stores.retrain_jobs import RetrainJobStore
from gateway.stores.site_store import sync_sites
from gateway.tenancy.admission import Tenancy
from gateway.tenancy.key_limits import KeyLimits, LocalKeyLimits
from gateway.tenancy.keys import KeyService
from gateway.tenancy.limiter import SlidingWindowLimiter
from gateway.tenancy.shared_limits import SharedKeyLimits
from gateway.tokenize_pool import TokenizePool
from gateway.tokenizers import ModelTokenizers

log = logging.getLogger(__name__)


def _ensure_sqlite_dir(database_url: str) -> None:
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)


def _key_limits(database_url: str, overshoot: float, metrics: GatewayMetrics) -> KeyLimits:
    """On PostgreSQL, which several gateways may share, a key's limits hold across all of them;
    SQLite serves one gateway, which counts them in memory."""
    if make_url(database_url).get_backend_name() != "postgresql":
        return LocalKeyLimits(SlidingWindowLimiter(overshoot=overshoot))
    store = KeyLimitStore(create_counter_engine(database_url), gateway_id=uuid.uuid4().hex)
    limits = SharedKeyLimits(store, overshoot=overshoot)
    metrics.watch_backlog(
        "shared_limits_pending",
        "Settlements and concurrency slots of API keys not yet written to the shared counters "
        "(above 0 for long: the database refuses them)",
        lambda: limits.pending,
    )
    return limits


def _task_of(federation: FederationConfig, model: str) -> ModelTask:
    config = federation.model(model)
    return config.task if config is not None else "generate"


def _embedding_service(
    settings: GatewaySettings,
    federation: FederationConfig,
    registry: SiteRegistry,
    tokenizers: ModelTokenizers,
    completions: CompletionService,
) -> EmbeddingService:
    """The Embeddings API, admitted and recorded by the completions' own owners (one in-flight
    bound and one request log for every API)."""
    return EmbeddingService(
        EmbeddingPreparer(
            registry,
            tokenizers,
            [model.name for model in federation.embedding_models],
            settings.limits.max_prompt_chars_per_token,
        ),
        EmbeddingRouter(
            registry,
            completions.metrics,
            settings.routing.site_max_queued_requests or None,
            settings.routing.site_max_queued_tokens or None,
        ),
        completions.admitter,
        completions.records,
        completions.metrics,
        settings.limits.request_timeout_s,
    )


@dataclass(frozen=True, slots=True)
class GatewayAssembly:
    """The gateway's long-lived parts, each built once; the HTTP layer is handed the ones each
    controller uses (gateway/app.py), never the whole."""

    settings: GatewaySettings
    engine: AsyncEngine
    registry: SiteRegistry
    tokenizers: ModelTokenizers
    # Where client prompts are tokenized, off the event loop.
    tokenize_pool: TokenizePool
    completions: CompletionService
    chat: ChatService
    # POST /v1/embeddings, for the models the federation file marks as embedding models.
    embeddings: EmbeddingService
    # Uploaded batch input files and the batches' result files (the Files API).
    files: FileService
    batches: BatchService
    # The Responses API over chat, and its stored responses.
    responses: ResponsesService
    # Stored results of requests sent with an Idempotency-Key (gateway/idempotency.py).
    idempotency: Idempotency
    # API keys and their limits (counted in this process on SQLite, in PostgreSQL for every
    # gateway of the database together).
    tenancy: Tenancy
    # The admin dashboard's views (its history is written by the load-sampler task).
    dashboard: Dashboard
    # Operators' drains of sites (gateway/admin/drain.py).
    drainer: SiteDrainer
    # Sites joining and leaving at run time (gateway/admin/membership.py).
    membership: SiteMembership
    # LoRA adapters loaded and unloaded at run time (gateway/admin/adapters.py).
    adapter_admin: AdapterAdmin
    # LoRA fine-tuning jobs trained on the sites, served as adapters (gateway/fine_tuning/).
    fine_tuning: FineTuningService
    # Capacity that follows load (gateway/scaling/), when GATEWAY_SCALING_FILE names models.
    scaling: ScalingController | None
    # Each served model's predictor error on recent traffic, and the retrain jobs asked for.
    retraining: Retraining
    readiness: Readiness
    # The dashboard's sign-ins, revocable on every gateway of the database (api/admin_auth.py).
    admin_sessions: AdminSessionStore
    # Failed dashboard sign-ins, counted by every gateway of the database together.
    login_failures: LoginFailureStore
    # This gateway's Prometheus registry (its own, not the process-global one): GET /metrics.
    metrics: GatewayMetrics
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def start(cls, settings: GatewaySettings) -> GatewayAssembly:
        federation = load_federation(settings.federation_file)
        served = frozenset(model.name for model in federation.models)
        scaling_file = settings.scaling.file
        scaling = load_scaling(scaling_file, served) if scaling_file is not None else None
        site_tls = load_site_tls(settings)  # unreadable certificate files stop the start
        tokenizers = ModelTokenizers(federation.models)
        # A bad template stops the start; an embedding model has none (it does not chat).
        chat_templates = ChatTemplates.load(federation.generative_models)
        if settings.database.auto_migrate:
            _ensure_sqlite_dir(settings.database.url)
            await asyncio.to_thread(upgrade, settings.database.url)
        engine = create_engine(settings.database.url)
        sessions = create_sessionmaker(engine)
        site_ids = await sync_sites(sessions, federation.sites)
        # The chunk budget every answer streamed from this project's sites shares.
        pacer = ChunkPacer(settings.sites.stream_chunks_per_s)
        registry = SiteRegistry(
            SiteState(
                config=site,
                site_id=site_ids[site.name],
                client=site_client(
                    site,
                    settings.sites.connect_timeout_s,
                    site_tls,
                    tokenizers,
                    _task_of(federation, site.model),
                    pacer,
                ),
                prefix=SitePrefix(settings.routing.prefix_index_max_blocks),
            )
            for site in federation.sites
        )
        listener = LoadReportListener(
            registry, settings.sites.load_report_interval_ms, settings.sites.load_report_stale_s
        )
        monitor = HealthMonitor(
            registry,
            tokenizers.fingerprints,
            settings.sites.health_interval_s,
            listener.stale,
            tasks={model.name: model.task for model in federation.models},
            failures_to_down=settings.sites.health_failures_to_down,
        )
        await monitor.check_once()  # route from the first request on, not after one interval
        predictor_registry = PredictorRegistry(sessions)
        # Only generative models have answers whose length to predict.
        generative = federation.generative_models
        predictor = await start_predictors(settings, generative, predictor_registry)
        predictor.start()
        metrics = GatewayMetrics()
        metrics.watch_sites(registry.all)
        predictor.metrics = metrics
        adapter_catalogue = AdapterCatalogue(
            registry, federation.adapters, AdapterOwnerStore(sessions)
        )
        await adapter_catalogue.refresh()  # owners before the first request
        completions = CompletionService(
            settings,
            registry,
            tokenizers,
            build_policy(
                settings.routing.policy,
                settings.routing.site_max_queued_requests or None,
                settings.routing.site_max_queued_tokens or None,
                federation.routing_profiles,
                settings.routing.adapter_routing,
            ),
            RequestLog(sessions),
            predictor,
            metrics,
            frozenset(m.name for m in federation.models if m.share_prefix_cache),
            frozenset(m.name for m in federation.embedding_models),
            adapter_catalogue,
        )
        embeddings = _embedding_service(settings, federation, registry, tokenizers, completions)
        key_limits = _key_limits(
            settings.database.url, settings.limits.token_limit_overshoot, metrics
        )
        drainer = SiteDrainer(registry, settings.offload.interval_s)
        membership = SiteMembership(
            registry,
            sessions,
            (monitor, listener),
            drainer,
            lambda site: site_client(
                site,
                settings.sites.connect_timeout_s,
                site_tls,
                tokenizers,
                pacer=pacer,
            ),
            settings.routing.prefix_index_max_blocks,
            federation.models,
            settings.federation_file.resolve().parent,
            metrics,
            scaling.drain_timeout_s if scaling is not None else 600.0,
        )
        controller = (
            build_controller(scaling, registry, membership, sessions, metrics)
            if scaling is not None and scaling.models
            else None
        )
        sampler = LoadSampler(
            registry,
            sessions,
            interval_s=settings.history.load_sample_interval_s,
            retention_s=settings.history.load_history_retention_h * 3600,
            request_timeout_s=settings.limits.request_timeout_s,
        )
        tokenize_pool = TokenizePool(settings.server.tokenize_threads)
        tool_formats = {model.name: model.tool_call_format for model in generative}
        chat = ChatService(
            chat_templates,
            tokenizers,
            completions,
            tool_formats,
            parse_special_tokens=[
                model.name for model in generative if model.parse_special_tokens_in_messages
            ],
        )
        files = FileService(settings, FileStore(sessions), tokenize_pool)
        responses = ResponsesService(chat, ResponseStore(sessions), settings.responses)
        tenancy = Tenancy(KeyService(sessions), key_limits, settings.access.require_api_keys)
        batches = BatchService.build(
            settings,
            sessions,
            completions,
            chat,
            registry,
            files,
            tokenize_pool,
            status_of=http_status,
            tenancy=tenancy,
        )
        tenancy.add_revoke_hook(batches.runner.key_revoked)  # a revoked key's batches stop
        served_models = [model.name for model in generative]
        retrain_jobs = RetrainJobStore(sessions)
        health = PredictorHealth(
            sessions, served_models, settings.drift, settings.retrain, retrain_jobs
        )
        health.watch(metrics)
        adapter_admin = AdapterAdmin(
            registry,
            adapter_catalogue,
            frozenset(served_models),
            tenancy.keys,
            frozenset(model.name for model in federation.models),
            settings.sites.adapter_load_timeout_s,
        )
        fine_tuning = FineTuningService.build(
            sessions,
            registry,
            adapter_catalogue,
            adapter_admin,
            metrics,
            {model.name: str(model.tokenizer) for model in generative},
            settings.fine_tuning,
        )
        assembly = cls(
            settings=settings,
            engine=engine,
            registry=registry,
            tokenizers=tokenizers,
            tokenize_pool=tokenize_pool,
            completions=completions,
            chat=chat,
            embeddings=embeddings,
            files=files,
            batches=batches,
            responses=responses,
            idempotency=Idempotency(
                IdempotencyStore(sessions),
                settings.limits.idempotency_ttl_s,
                settings.limits.request_timeout_s,
            ),
            tenancy=tenancy,
            dashboard=Dashboard(settings, registry, sessions),
            drainer=drainer,
            membership=membership,
            adapter_admin=adapter_admin,
            fine_tuning=fine_tuning,
            scaling=controller,
            retraining=Retraining(
                health, retrain_jobs, predictor, settings.drift, settings.retrain, served_models
            ),
            readiness=Readiness(
                registry, sessions, predictor, drainer, completions.records.writer, served_models
            ),
            admin_sessions=AdminSessionStore(sessions),
            login_failures=LoginFailureStore(sessions),
            metrics=metrics,
        )
        background = {
            "site-health": monitor.run(),
            "load-reports": listener.run(),
            "load-sampler": sampler.run(),
            "predictor-registry": follow_registry(
                predictor,
                predictor_registry,
                served_models,
                settings.predictor.poll_s,
            ),
            "predictor-drift": health.run(),
            "site-drain": drainer.run(),
            "file-retention": files.delete_expired_forever(),
            "response-retention": responses.delete_expired_forever(),
            "fine-tuning": fine_tuning.runner.run(),
            "fine-tuning-checks": fine_tuning.run(),
            "adapter-owners": adapter_catalogue.run(settings.sites.health_interval_s),
            **kv_event_followers(registry.all()),
        }
        missing = missing_training_stack()
        if settings.retrain.worker and missing:
            log.info("retrain jobs wait for a trainer (`--run-queued`): no %s", ", ".join(missing))
        elif settings.retrain.worker:
            worker = RetrainWorker(retrain_jobs, settings.retrain, settings.database.url)
            background["retrain-worker"] = worker.run()
        if isinstance(key_limits, SharedKeyLimits):
            background["shared-limits"] = key_limits.run()
        if controller is not None:
            background["scaling"] = controller.run()
        governor = ChunkGovernor.of(
            settings.sites.stream_chunks_per_s, settings.sites.stream_chunks_min_per_s
        )
        if governor is not None:
            background["chunk-governor"] = govern(pacer, governor)
        if settings.offload.enabled:
            offload = OffloadCoordinator(
                registry, settings.offload.interval_s, settings.offload.transfer_cost_s, metrics
            )
            background["offload"] = offload.run()
        await fine_tuning.runner.declare_trained()  # their owners, before a request comes
        for name, work in background.items():
            assembly.tasks.append(asyncio.create_task(work, name=name))
        assembly.batches.runner.start()  # resumes the batches left unfinished
        healthy = sum(site.healthy for site in registry.all())
        log.info("gateway up: %d/%d sites healthy", healthy, len(registry.all()))
        return assembly

    async def stop(self) -> None:
        await self.batches.runner.stop()  # first: its items wait on the predictor and sites
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.scaling is not None:
            await self.scaling.close()  # the sites its actuators started stop with the gateway
        await self.membership.close()
        await self.completions.prediction.predictors.stop()
        await self.completions.drain()
        if isinstance(self.tenancy.limits, SharedKeyLimits):
            await self.tenancy.limits.close()  # its engine with it
        await self.idempotency.drain()
        self.tokenize_pool.close()
        await self.fine_tuning.close()  # its checking processes end before the gateway does
        await self.registry.close()
        await self.engine.dispose()
