"""The litestar application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin, YamlRenderPlugin

from gateway.api.admin_keys import AdminKeysController
from gateway.api.admin_pages import admin_router
from gateway.api.batches import BatchesController
from gateway.api.chat import ChatController
from gateway.api.client_auth import authenticate_caller
from gateway.api.completions import CompletionsController
from gateway.api.db_errors import DATABASE_EXCEPTION_HANDLERS
from gateway.api.errors import EXCEPTION_HANDLERS
from gateway.api.metrics import HttpMetricsMiddleware, MetricsController
from gateway.api.models import HealthController, ModelsController
from gateway.completions import CompletionService
from gateway.runtime import GatewayRuntime
from gateway.settings import GatewaySettings


def _runtime(state: State) -> GatewayRuntime:
    runtime: GatewayRuntime = state.runtime
    return runtime


def _completions(state: State) -> CompletionService:
    return _runtime(state).completions


def create_app(settings: GatewaySettings) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.runtime = await GatewayRuntime.start(settings)
        try:
            yield
        finally:
            await app.state.runtime.stop()

    return Litestar(
        route_handlers=[
            CompletionsController,
            ChatController,
            BatchesController,
            ModelsController,
            HealthController,
            admin_router(),
            MetricsController,
            AdminKeysController,
        ],
        dependencies={
            "runtime": Provide(_runtime, sync_to_thread=False),
            "completions": Provide(_completions, sync_to_thread=False),
            # The client APIs' caller: 401 before anything else for a key that is not allowed.
            "caller": Provide(authenticate_caller),
        },
        exception_handlers={**EXCEPTION_HANDLERS, **DATABASE_EXCEPTION_HANDLERS},
        middleware=[HttpMetricsMiddleware],
        lifespan=[lifespan],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="fedllm gateway", version="0.1.0", render_plugins=_openapi_pages(settings)
        ),
    )


def _openapi_pages(settings: GatewaySettings) -> tuple[OpenAPIRenderPlugin, ...]:
    """The schema as JSON and YAML; the UI pages (scripts from CDNs) only when asked for, as
    litestar's defaults (an empty tuple)."""
    return () if settings.openapi_ui else (JsonRenderPlugin(), YamlRenderPlugin())
