"""POST /v1/completions: a thin controller over CompletionService."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.response import Stream

from gateway.api.body import decode_body
from gateway.api.openai_format import collect_completion, completion_events
from gateway.api.openapi_body import json_body
from gateway.api.schemas import Completion, CompletionRequest
from gateway.completions import CompletionService
from gateway.tenancy.admission import Caller

SITE_HEADER = "X-Fedllm-Site"


class CompletionsController(Controller):
    path = "/v1"
    tags = ("openai",)

    @post(
        "/completions",
        status_code=200,
        summary="Create a completion (OpenAI-compatible)",
        operation_class=json_body(CompletionRequest),
    )
    async def create_completion(
        self, request: Request[Any, Any, Any], completions: CompletionService, caller: Caller
    ) -> Response[Completion] | Stream:
        prepared = completions.prepare(decode_body(await request.body(), CompletionRequest))
        dispatch = await completions.dispatch(prepared, caller.admission())
        if prepared.stream:
            return Stream(
                completion_events(dispatch),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", SITE_HEADER: dispatch.site.name},
            )
        completion = await collect_completion(dispatch)
        return Response(completion, headers={SITE_HEADER: dispatch.site.name})
