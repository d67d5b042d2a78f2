"""POST /v1/chat/completions: a thin controller over ChatService and CompletionService."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.response import Stream

from gateway.api.chat_schemas import ChatCompletion, ChatCompletionRequest, decode_chat_request
from gateway.api.completion_routes import CompletionCall, OpenAIAnswer, answer
from gateway.api.openai_format import chat_completion_events, collect_chat_completion
from gateway.api.openapi_body import json_body


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
        completion_call: NamedDependency[CompletionCall],
    ) -> Response[ChatCompletion] | Stream:
        body = await request.body()
        req = decode_chat_request(body)
        completion_call.check_owner(req.model)
        prepared = await completion_call.tokenize_pool.run(
            completion_call.chat.prepare, req, len(body)
        )
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
            completion_call,
        )
