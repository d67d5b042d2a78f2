"""The routes every HTTP face of a site answers alike, the generative (openai_http.py) and the
embedding one (embedding_http.py): its model card, its metrics and its health."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import MediaType, get
from litestar.handlers import HTTPRouteHandler
from prometheus_client import CollectorRegistry, generate_latest


def common_routes(
    model: str, max_model_len: Callable[[], int | None], registry: CollectorRegistry
) -> list[HTTPRouteHandler]:
    """GET /v1/models (the one model, its length read at each call), /metrics and /health."""

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model, "object": "model", "owned_by": "fedllm",
                "max_model_len": max_model_len()}  # fmt: skip
        return {"object": "list", "data": [card]}

    @get("/metrics", media_type=MediaType.TEXT)
    async def metrics() -> bytes:
        return generate_latest(registry)

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return [models, metrics, health]
