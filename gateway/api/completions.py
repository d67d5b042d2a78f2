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
from gateway.idempotency import HEADER, REPLAYED_HEADER
from gateway.runtime import GatewayRuntime
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
        self,
        request: Request[Any, Any, Any],
        completions: CompletionService,
        runtime: GatewayRuntime,
        caller: Caller,
    ) -> Response[Completion] | Stream:
        body = await request.body()
        prepared = completions.prepare(decode_body(body, CompletionRequest))
        claim = await runtime.idempotency.claim(
            request.headers.get(HEADER), caller.key_id, "/v1/completions", body, prepared.stream
        )
        if prepared.stream:  # (a stream never has a claim: the key is refused with it)
            dispatch = await completions.dispatch(prepared, caller.admission())
            return Stream(
                completion_events(dispatch),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", SITE_HEADER: dispatch.site.name},
            )
        sites: list[str] = []

        async def run() -> Completion:
            dispatch = await completions.dispatch(prepared, caller.admission())
            completion = await collect_completion(dispatch)
            sites.append(dispatch.site.name)
            return completion

        completion, replayed = await runtime.idempotency.once(claim, Completion, run)
        return Response(completion, headers=answer_headers(sites, replayed))


def answer_headers(sites: list[str], replayed: bool) -> dict[str, str]:
    """The site that finished the answer; a replay names none (it ran earlier)."""
    return {REPLAYED_HEADER: "true"} if replayed else {SITE_HEADER: sites[-1]}
