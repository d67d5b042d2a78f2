"""GET /v1/models and the health probes."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get
from litestar.di import NamedDependency

from gateway.admin.readiness import Readiness
from gateway.api.admin_auth import is_operator
from gateway.api.client_auth import require_client_key
from gateway.api.completion_schemas import ModelCard, ModelList
from gateway.errors import model_not_found
from gateway.tokenizers import ModelTokenizers


class ModelsController(Controller):
    path = "/v1"
    tags = ("openai",)

    # Needs a key when keys are required (as OpenAI's does), but charges no limit.
    @get(
        "/models",
        guards=[require_client_key],
        summary="Models served by at least one configured site",
    )
    async def list_models(self, tokenizers: NamedDependency[ModelTokenizers]) -> ModelList:
        return ModelList(data=[ModelCard(id=name) for name in tokenizers.models()])

    @get(
        "/models/{model_id:path}",
        guards=[require_client_key],
        summary="One model served by at least one configured site",
    )
    async def get_model(
        self, tokenizers: NamedDependency[ModelTokenizers], model_id: str
    ) -> ModelCard:
        name = model_id.lstrip("/")  # a path parameter keeps ids with '/' (org/model) whole
        if name not in tokenizers.models():
            raise model_not_found(name)
        return ModelCard(id=name)


class HealthController(Controller):
    path = "/"
    tags = ("operations",)

    @get("/healthz", summary="Liveness: the process serves HTTP")
    async def liveness(self) -> dict[str, str]:
        return {"status": "ok"}

    @get(
        "/readyz",
        summary="Readiness: the database answers and at least one site is healthy (200, else "
        "503); the detail (sites, drains, request log, predictors) for the admin credential",
    )
    async def readiness(
        self, request: Request[Any, Any, Any], readiness: NamedDependency[Readiness]
    ) -> Response[dict[str, object]]:
        # The sites' names, the predictor's versions and the backlog are the operator's to see
        # (issue 48); a load balancer needs only the status. A wrong admin credential counts as
        # a guess, as anywhere: the two answers differ.
        operator = await is_operator(request)
        body = await readiness.report()
        status = 200 if body["ready"] else 503
        return Response(body if operator else {"ready": body["ready"]}, status_code=status)
