"""The litestar application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from gateway.api.completions import CompletionsController
from gateway.api.errors import EXCEPTION_HANDLERS
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
        route_handlers=[CompletionsController, ModelsController, HealthController],
        dependencies={
            "runtime": Provide(_runtime, sync_to_thread=False),
            "completions": Provide(_completions, sync_to_thread=False),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(title="fedllm gateway", version="0.1.0"),
    )
