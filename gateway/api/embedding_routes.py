"""POST /v1/embeddings: a thin controller over EmbeddingService (gateway/embeddings/)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency

from gateway.api.body import decode_body
from gateway.api.completion_routes import SITE_HEADER
from gateway.api.embedding_schemas import EmbeddingList, EmbeddingRequest, embedding_list
from gateway.api.openapi_body import json_body
from gateway.embeddings.service import EmbeddingService
from gateway.tenancy.admission import Caller
from gateway.tokenize_pool import TokenizePool


class EmbeddingsController(Controller):
    path = "/v1"
    tags = ("openai",)

    @post(
        "/embeddings",
        status_code=200,
        summary="Create embeddings (OpenAI-compatible) with a model served as an embedding model",
        operation_class=json_body(EmbeddingRequest),
    )
    async def create_embeddings(
        self,
        request: Request[Any, Any, Any],
        caller: NamedDependency[Caller],
        embeddings: NamedDependency[EmbeddingService],
        tokenize_pool: NamedDependency[TokenizePool],
    ) -> Response[EmbeddingList]:
        body = await request.body()
        prepared = await tokenize_pool.run(
            embeddings.prepare, decode_body(body, EmbeddingRequest), len(body)
        )
        embedded = await embeddings.embed(prepared, caller.admission())
        return Response(embedding_list(embedded), headers={SITE_HEADER: embedded.site})
