"""POST /v1/chat/completions: a thin controller over ChatService and CompletionService."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import Provide
from litestar.response import Stream

from gateway.api.chat_schemas import ChatCompletion, ChatCompletionRequest, decode_chat_request
from gateway.api.completions import SITE_HEADER, answer_headers
from gateway.api.openai_format import chat_completion_events, collect_chat_completion
from gateway.api.openapi_body import json_body
from gateway.chat import ChatService
from gateway.completions import CompletionService
from gateway.idempotency import HEADER
from gateway.runtime import GatewayRuntime
from gateway.tenancy.admission import Caller


def _chat(runtime: GatewayRuntime) -> ChatService:
    return runtime.chat


class ChatController(Controller):
    path = "/v1"
    tags = ("openai",)
    dependencies = {"chat": Provide(_chat, sync_to_thread=False)}  # noqa: RUF012 (litestar's)

    @post(
        "/chat/completions",
        status_code=200,
        summary="Create a chat completion (OpenAI-compatible)",
        operation_class=json_body(ChatCompletionRequest),
    )
    async def create_chat_completion(
        self,
        request: Request[Any, Any, Any],
        chat: ChatService,
        completions: CompletionService,
        runtime: GatewayRuntime,
        caller: Caller,
    ) -> Response[ChatCompletion] | Stream:
        body = await request.body()
        prepared = chat.prepare(decode_chat_request(body))
        claim = await runtime.idempotency.claim(
            request.headers.get(HEADER),
            caller.key_id,
            "/v1/chat/completions",
            body,
            prepared.stream,
        )
        if prepared.stream:  # (a stream never has a claim: the key is refused with it)
            dispatch = await completions.dispatch(prepared, caller.admission())
            return Stream(
                chat_completion_events(dispatch),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", SITE_HEADER: dispatch.site.name},
            )
        sites: list[str] = []

        async def run() -> ChatCompletion:
            dispatch = await completions.dispatch(prepared, caller.admission())
            completion = await collect_chat_completion(dispatch)
            sites.append(dispatch.site.name)
            return completion

        completion, replayed = await runtime.idempotency.once(claim, ChatCompletion, run)
        return Response(completion, headers=answer_headers(sites, replayed))
