"""The litestar application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin, YamlRenderPlugin

from gateway.api.admin_auth import AdminAccess, LoginThrottle
from gateway.api.admin_pages import admin_router
from gateway.api.batch_routes import BatchesController
from gateway.api.chat_routes import ChatController
from gateway.api.client_auth import authenticate_caller
from gateway.api.completion_routes import CompletionsController, provide_completion_call
from gateway.api.database_errors import DATABASE_EXCEPTION_HANDLERS
from gateway.api.embedding_routes import EmbeddingsController
from gateway.api.file_routes import FilesController
from gateway.api.fine_tuning_routes import FineTuningController
from gateway.api.key_routes import AdminKeysController
from gateway.api.metrics_routes import HttpMetricsMiddleware, MetricsController
from gateway.api.model_routes import HealthController, ModelsController
from gateway.api.openai_errors import EXCEPTION_HANDLERS
from gateway.api.responses_routes import ResponsesController, provide_response_call
from gateway.assembly import GatewayAssembly
from gateway.settings import GatewaySettings

# The services controllers receive by name (litestar dependency injection): each handler asks
# for the ones it uses, never for the whole assembly.
PROVIDED = (
    "settings",
    "tokenizers",
    "completions",
    "embeddings",
    "tokenize_pool",
    "files",
    "batches",
    "responses",
    "idempotency",
    "tenancy",
    "dashboard",
    "drainer",
    "membership",
    "adapter_admin",
    "fine_tuning",
    "scaling",
    "retraining",
    "readiness",
    "metrics",
)


def _provider(name: str) -> Provide:
    def provide(state: State) -> object:
        return getattr(state.assembly, name)

    return Provide(provide, sync_to_thread=False)


def create_app(settings: GatewaySettings) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        assembly = await GatewayAssembly.start(settings)
        app.state.assembly = assembly
        # What guards and middleware read (they take no dependencies).
        app.state.tenancy = assembly.tenancy
        app.state.metrics = assembly.metrics
        app.state.admin_access = AdminAccess(
            settings.admin.token,
            settings.admin.session_ttl_s,
            settings.server.host,
            assembly.admin_sessions,
            LoginThrottle(assembly.login_failures),
            settings.admin.metrics_token,
        )
        try:
            yield
        finally:
            await assembly.stop()

    return Litestar(
        route_handlers=[
            CompletionsController,
            ChatController,
            EmbeddingsController,
            ResponsesController,
            FilesController,
            BatchesController,
            FineTuningController,
            ModelsController,
            HealthController,
            admin_router(),
            MetricsController,
            AdminKeysController,
        ],
        dependencies={
            **{name: _provider(name) for name in PROVIDED},
            # The client APIs' caller: 401 before anything else for a key that is not allowed.
            "caller": Provide(authenticate_caller),
            "completion_call": Provide(provide_completion_call),
            "response_call": Provide(provide_response_call),
        },
        exception_handlers={**EXCEPTION_HANDLERS, **DATABASE_EXCEPTION_HANDLERS},
        middleware=[HttpMetricsMiddleware],
        lifespan=[lifespan],
        request_max_body_size=settings.limits.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="fedllm gateway", version="0.1.0", render_plugins=_openapi_pages(settings)
        ),
    )


def _openapi_pages(settings: GatewaySettings) -> tuple[OpenAPIRenderPlugin, ...]:
    """The schema as JSON and YAML; the UI pages (scripts from CDNs) only when asked for, as
    litestar's defaults (an empty tuple)."""
    return () if settings.server.openapi_ui else (JsonRenderPlugin(), YamlRenderPlugin())
