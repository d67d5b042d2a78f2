"""/v1/responses: a thin controller over ResponsesService (gateway/responses/service.py), as the
openai clients call it (responses.create, retrieve, delete, input_items.list)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Stream

from gateway.api.client_auth import require_client_key
from gateway.api.completion_routes import (
    CompletionCall,
    OpenAIAnswer,
    answer,
    provide_completion_call,
)
from gateway.api.openai_errors import invalid_request
from gateway.api.openapi_body import json_body
from gateway.api.responses_schemas import (
    InputItemList,
    ResponseCreateRequest,
    ResponseDeleted,
    ResponseObject,
    decode_response_request,
)
from gateway.dispatch.stream import Dispatch
from gateway.responses.answer import collect_response, response_events
from gateway.responses.service import ResponsePlan, ResponsesService
from gateway.tenancy.admission import Caller

DEFAULT_ITEMS_PAGE = 20  # OpenAI's


@dataclass(frozen=True, slots=True)
class ResponseCall:
    """What POST /v1/responses uses, as one litestar dependency (as `completion_call`)."""

    call: CompletionCall
    responses: ResponsesService


async def provide_response_call(request: Request[Any, Any, Any]) -> ResponseCall:
    call = await provide_completion_call(request)  # 401 first for a key that is not allowed
    return ResponseCall(call, request.app.state.assembly.responses)


async def _sse(
    dispatch: Dispatch, plan: ResponsePlan, service: ResponsesService
) -> AsyncIterator[bytes]:
    """The stream's events as SSE, each named by its type as OpenAI sends them (no [DONE])."""
    save = partial(service.save, plan)
    async for event in response_events(dispatch, plan.draft, save):
        yield b"event: " + event.type.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


async def _collect(
    dispatch: Dispatch, plan: ResponsePlan, service: ResponsesService
) -> ResponseObject:
    response = await collect_response(dispatch, plan.draft)
    await service.save(plan, response)
    return response


class ResponsesController(Controller):
    path = "/v1/responses"
    tags = ("openai",)

    @post(
        "/",
        status_code=200,
        summary="Create a model response (OpenAI's Responses API)",
        operation_class=json_body(ResponseCreateRequest),
    )
    async def create_response(
        self,
        request: Request[Any, Any, Any],
        response_call: NamedDependency[ResponseCall],
    ) -> Response[ResponseObject] | Stream:
        call, service = response_call.call, response_call.responses
        body = await request.body()
        req = decode_response_request(body)
        call.check_owner(req.model)
        owner = call.caller.key_id
        earlier = await service.earlier(req, owner)
        prepare = partial(service.prepare, earlier=earlier, owner=owner)
        plan = await call.tokenize_pool.run(prepare, req, len(body))
        shape = OpenAIAnswer(
            "/v1/responses",
            ResponseObject,
            partial(_sse, plan=plan, service=service),
            partial(_collect, plan=plan, service=service),
        )
        return await answer(shape, request, body, plan.prepared, call)

    @get("/{response_id:str}", guards=[require_client_key], summary="A stored response")
    async def get_response(
        self,
        responses: NamedDependency[ResponsesService],
        caller: NamedDependency[Caller],
        response_id: FromPath[str],
        stream: FromQuery[bool] = False,
    ) -> ResponseObject:
        if stream:  # OpenAI replays the events of a background response, never run here
            raise invalid_request(
                "streaming a stored response is offered for background responses only, which "
                "this gateway does not run",
                param="stream",
            )
        return await responses.get(response_id, caller.key_id)

    @delete(
        "/{response_id:str}",
        status_code=200,
        guards=[require_client_key],
        summary="Delete a stored response",
    )
    async def delete_response(
        self,
        responses: NamedDependency[ResponsesService],
        caller: NamedDependency[Caller],
        response_id: FromPath[str],
    ) -> ResponseDeleted:
        await responses.delete(response_id, caller.key_id)
        return ResponseDeleted(id=response_id)

    @get(
        "/{response_id:str}/input_items",
        guards=[require_client_key],
        summary="A stored response's input items, newest first unless order=asc",
    )
    async def list_input_items(
        self,
        responses: NamedDependency[ResponsesService],
        caller: NamedDependency[Caller],
        response_id: FromPath[str],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = DEFAULT_ITEMS_PAGE,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
    ) -> InputItemList:
        page = await responses.input_items(response_id, caller.key_id, after, limit, order)
        data = page.data
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return InputItemList(data=data, first_id=first, last_id=last, has_more=page.has_more)
