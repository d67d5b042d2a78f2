"""GET /v1/models and the health probes."""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.admin.readiness import Readiness
from gateway.api.client_auth import require_client_key
from gateway.api.completion_schemas import ModelCard, ModelList
from gateway.errors import model_not_found
from gateway.model_catalogue import ServedAdapter
from gateway.request_path.service import CompletionService
from gateway.tenancy.admission import Caller
from gateway.tokenizers import ModelTokenizers


class ModelsController(Controller):
    path = "/v1"
    tags = ("openai",)

    # Needs a key when keys are required (as OpenAI's does), but charges no limit.
    @get(
        "/models",
        guards=[require_client_key],
        summary="Models served by at least one configured site, and the LoRA adapters healthy "
        "sites serve (each with its base as `parent`) that the key may use",
    )
    async def list_models(
        self,
        tokenizers: NamedDependency[ModelTokenizers],
        completions: NamedDependency[CompletionService],
        caller: Caller,
    ) -> ModelList:
        bases = [ModelCard(id=name, root=name) for name in tokenizers.models()]
        adapters = completions.preparer.adapters.served(caller.key_id, _key_name(caller))
        return ModelList(data=[*bases, *(_adapter_card(a) for a in adapters)])

    @get(
        "/models/{model_id:path}",
        guards=[require_client_key],
        summary="One model served by at least one configured site, or a LoRA adapter",
    )
    async def get_model(
        self,
        tokenizers: NamedDependency[ModelTokenizers],
        completions: NamedDependency[CompletionService],
        caller: Caller,
        model_id: str,
    ) -> ModelCard:
        name = model_id.lstrip("/")  # a path parameter keeps ids with '/' (org/model) whole
        if name in tokenizers.models():
            return ModelCard(id=name, root=name)
        catalogue = completions.preparer.adapters
        adapter = catalogue.find(name)
        if adapter is None or not catalogue.may_use(name, caller.key_id, _key_name(caller)):
            raise model_not_found(name)
        return _adapter_card(adapter)


def _key_name(caller: Caller) -> str | None:
    return caller.key.name if caller.key is not None else None


def _adapter_card(adapter: ServedAdapter) -> ModelCard:
    return ModelCard(id=adapter.name, root=adapter.parent, parent=adapter.parent)


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
