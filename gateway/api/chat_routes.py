"""POST /v1/chat/completions: a thin controller over ChatService and CompletionService."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.response import Stream

from gateway.api.chat_schemas import ChatCompletion, ChatCompletionRequest, decode_chat_request
from gateway.api.completion_routes import OpenAIAnswer, answer
from gateway.api.openai_format import chat_completion_events, collect_chat_completion
from gateway.api.openapi_body import json_body
from gateway.chat.service import ChatService
from gateway.completions.service import CompletionService
from gateway.idempotency import Idempotency
from gateway.tenancy.admission import Caller
from gateway.tokenize_pool import TokenizePool


class ChatController(Controller):
    path = "/v1"
    tags = ("openai",)

    @post(
        "/chat/completions",
        status_code=200,
        summary="Create a chat completion (OpenAI-compatible)",
        operation_class=json_body(ChatCompletionRequest),
    )
    async def create_chat_completion(
        self,
        request: Request[Any, Any, Any],
        chat: NamedDependency[ChatService],
        completions: NamedDependency[CompletionService],
        tokenize_pool: NamedDependency[TokenizePool],
        idempotency: NamedDependency[Idempotency],
        caller: NamedDependency[Caller],
    ) -> Response[ChatCompletion] | Stream:
        body = await request.body()
        prepared = await tokenize_pool.run(chat.prepare, decode_chat_request(body), len(body))
        return await answer(
            OpenAIAnswer(
                "/v1/chat/completions",
                ChatCompletion,
                chat_completion_events,
                collect_chat_completion,
            ),
            request,
            body,
            prepared,
            completions,
            idempotency,
            caller,
        )
