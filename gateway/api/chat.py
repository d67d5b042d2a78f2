"""POST /v1/chat/completions: a thin controller over ChatService and CompletionService."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency, Provide
from litestar.response import Stream

from gateway.api.chat_schemas import ChatCompletion, ChatCompletionRequest, decode_chat_request
from gateway.api.completions import OpenAIAnswer, answer
from gateway.api.openai_format import chat_completion_events, collect_chat_completion
from gateway.api.openapi_body import json_body
from gateway.chat import ChatService
from gateway.completions import CompletionService
from gateway.runtime import GatewayRuntime
from gateway.tenancy.admission import Caller


def _chat(runtime: NamedDependency[GatewayRuntime]) -> ChatService:
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
        chat: NamedDependency[ChatService],
        completions: NamedDependency[CompletionService],
        runtime: NamedDependency[GatewayRuntime],
        caller: NamedDependency[Caller],
    ) -> Response[ChatCompletion] | Stream:
        body = await request.body()
        prepared = await runtime.tokenize_pool.run(chat.prepare, decode_chat_request(body))
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
            runtime,
            caller,
        )
