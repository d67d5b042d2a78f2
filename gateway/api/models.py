"""GET /v1/models and the health probes."""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.di import NamedDependency
from sqlalchemy import text

from gateway.api.client_auth import require_client_key
from gateway.api.schemas import ModelCard, ModelList
from gateway.runtime import GatewayRuntime
from gateway.services.predictor_registry import DEFAULT_MODEL


class ModelsController(Controller):
    path = "/v1"
    tags = ("openai",)

    # Needs a key when keys are required (as OpenAI's does), but charges no limit.
    @get(
        "/models",
        guards=[require_client_key],
        summary="Models served by at least one configured site",
    )
    async def list_models(self, runtime: NamedDependency[GatewayRuntime]) -> ModelList:
        return ModelList(data=[ModelCard(id=name) for name in runtime.tokenizers.models()])


class HealthController(Controller):
    path = "/"
    tags = ("operations",)

    @get("/healthz", summary="Liveness: the process serves HTTP")
    async def liveness(self) -> dict[str, str]:
        return {"status": "ok"}

    @get("/readyz", summary="Readiness: the database answers and at least one site is healthy")
    async def readiness(
        self, runtime: NamedDependency[GatewayRuntime]
    ) -> Response[dict[str, object]]:
        sites = {site.name: site.healthy for site in runtime.registry.all()}
        try:
            async with runtime.sessions() as session:
                await session.execute(text("SELECT 1"))
            database = "ok"
        except Exception as exc:  # any failure means not ready; the reason is reported
            database = f"error: {type(exc).__name__}"
        ready = database == "ok" and any(sites.values())
        predictors = runtime.completions.predictors.status()
        body: dict[str, object] = {
            "ready": ready,
            "database": database,
            "sites": sites,
            # Sites an operator is draining (they finish their work and take nothing new).
            "draining": runtime.drainer.draining(),
            "predictor": {
                "mode": predictors[DEFAULT_MODEL].mode,
                "version": predictors[DEFAULT_MODEL].version,
            },
            # Served models with a predictor of their own (the default predicts the others).
            "model_predictors": {
                model: status.version
                for model, status in predictors.items()
                if model != DEFAULT_MODEL
            },
        }
        return Response(body, status_code=200 if ready else 503)
