"""GET /v1/models and the health probes."""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.admin.readiness import Readiness
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
        "503); the report behind it is the operators' (/admin/api/readiness)",
    )
    async def readiness(self, readiness: NamedDependency[Readiness]) -> Response[dict[str, bool]]:
        # No site names, versions or backlog here (issue 48): anyone can reach this path, and a
        # load balancer needs only the status. It takes no credential either, so that a path
        # open to all is no place to guess the admin token (behind a load balancer, guesses
        # would be counted against the balancer's address, locking the operators out).
        ready = await readiness.ready()
        return Response({"ready": ready}, status_code=200 if ready else 503)
