"""POST /v1/completions: a thin controller over CompletionService."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from litestar import Controller, Request, Response, post
from litestar.background_tasks import BackgroundTask
from litestar.di import NamedDependency
from litestar.response import Stream

from gateway.api.body import decode_body
from gateway.api.client_auth import authenticate_caller
from gateway.api.client_gone import unless_client_leaves
from gateway.api.completion_schemas import Completion, CompletionRequest
from gateway.api.openai_format import (
    collect_completion,
    completion_events,
    merged_completion,
    prompt_list_events,
)
from gateway.api.openapi_body import json_body
from gateway.api.raw_headers import raw_header
from gateway.api.sse_stream import SseStream
from gateway.chat.service import ChatService
from gateway.dispatch.request import PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.idempotency import HEADER, REPLAYED_HEADER, Idempotency
from gateway.request_path.service import CompletionService
from gateway.tenancy.admission import Caller
from gateway.tokenize_pool import TokenizePool

SITE_HEADER = "X-Fedllm-Site"
T = TypeVar("T")
_IDEMPOTENCY_HEADER = HEADER.lower().encode()


@dataclass(frozen=True, slots=True)
class CompletionCall:
    """What the completion and chat endpoints use, resolved as one litestar dependency (named
    `completion_call`): litestar resolves a handler's independent dependencies as concurrent
    tasks, a task group and a task each per request, which cost these endpoints more than all
    the lookups they make."""

    caller: Caller
    completions: CompletionService
    chat: ChatService
    tokenize_pool: TokenizePool
    idempotency: Idempotency

    def check_owner(self, model: str) -> None:
        """The model resolved for the caller's key first: the 404 of an unknown model for a
        name not served and for another key's adapter alike, before anything else of the
        request is validated or tokenized, so the answer (status, body, time) is the same and a
        key cannot tell that the adapter exists."""
        key = self.caller.key
        self.completions.preparer.check_model_owner(
            model, self.caller.key_id, key.name if key is not None else None
        )


async def provide_completion_call(request: Request[Any, Any, Any]) -> CompletionCall:
    """The `completion_call` dependency: 401 first for a key that is not allowed."""
    caller = await authenticate_caller(request)
    services = request.app.state.assembly
    return CompletionCall(
        caller,
        services.completions,
        services.chat,
        services.tokenize_pool,
        services.idempotency,
    )


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
        completion_call: NamedDependency[CompletionCall],
    ) -> Response[Completion] | Stream:
        body = await request.body()
        req = decode_body(body, CompletionRequest)
        completion_call.check_owner(req.model)
        prepared = await completion_call.tokenize_pool.run(
            completion_call.completions.prepare_prompts, req, len(body)
        )
        shape = OpenAIAnswer("/v1/completions", Completion, completion_events, collect_completion)
        if len(prepared) > 1:
            return await answer_prompts(shape, request, body, prepared, completion_call)
        return await answer(shape, request, body, prepared[0], completion_call)


@dataclass(frozen=True, slots=True)
class OpenAIAnswer(Generic[T]):
    """How one OpenAI endpoint shapes a dispatched request: its SSE events when streamed, its
    response object otherwise."""

    endpoint: str
    response_type: type[T]
    events: Callable[[Dispatch], AsyncIterator[bytes]]
    collect: Callable[[Dispatch], Awaitable[T]]


async def answer(
    shape: OpenAIAnswer[T],
    request: Request[Any, Any, Any],
    body: bytes,
    prepared: PreparedCompletion,
    call: CompletionCall,
) -> Response[T] | Stream:
    """What the completion endpoints share after preparing the request: the Idempotency-Key,
    then a stream, or the whole answer (stored for retries under its key), cancelled if the
    client goes away before it is ready (gateway/api/client_gone.py)."""
    completions, idempotency, caller = call.completions, call.idempotency, call.caller
    key = raw_header(request.scope, _IDEMPOTENCY_HEADER)
    claim = await idempotency.claim(key, caller.key_id, shape.endpoint, body, prepared.stream)
    if prepared.stream:  # (a stream never has a claim: the key is refused with it)
        dispatch = await completions.dispatch(prepared, caller.admission())
        return event_stream(shape.events(dispatch), [dispatch])
    sites: list[str] = []

    async def run() -> T:
        dispatch = await completions.dispatch(prepared, caller.admission())
        answered = await unless_client_leaves(request.receive, shape.collect(dispatch))
        sites.append(dispatch.site.name)
        return answered

    answered, replayed = await idempotency.once(claim, shape.response_type, run)
    return Response(answered, headers=answer_headers(sites, replayed))


def event_stream(events: AsyncIterator[bytes], dispatches: list[Dispatch]) -> SseStream:
    """The SSE answer of dispatched requests, which always ends them: once the response is
    over, a request whose events were never reached (the client left before the stream began,
    or before it got that far) is recorded cancelled with nothing generated, its key settled
    and its slots given back. Before, such a request stayed `dispatched` forever."""
    return SseStream(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", SITE_HEADER: dispatches[0].site.name},
        background=EndUnstarted(dispatches),
    )


class EndUnstarted(BackgroundTask):
    """Ends the requests of a finished response that never began to stream (nothing for
    those that did: their streams record their own end): the response's background, which
    litestar awaits once the response is over. BackgroundTask's own constructor inspects its
    function each time (2 % of the gateway's event loop at a thousand streams); an async call,
    as this touches the event loop's state."""

    __slots__ = ("dispatches",)

    def __init__(self, dispatches: list[Dispatch]) -> None:  # no super().__init__: see above
        self.dispatches = dispatches

    async def __call__(self) -> None:
        for dispatch in self.dispatches:
            dispatch.cancel_unstarted("client went away")


def answer_headers(sites: list[str], replayed: bool) -> dict[str, str]:
    """The site that finished the answer; a replay names none (it ran earlier)."""
    return {REPLAYED_HEADER: "true"} if replayed else {SITE_HEADER: sites[-1]}


async def answer_prompts(
    shape: OpenAIAnswer[Completion],
    request: Request[Any, Any, Any],
    body: bytes,
    prompts: list[PreparedCompletion],
    call: CompletionCall,
) -> Response[Completion] | Stream:
    """A list of prompts: one request to its key, admitted whole (CompletionService.dispatch_all),
    each prompt dispatched to a site as its own request, answered as one completion whose
    choices are numbered prompt by prompt (OpenAI's `index` = prompt * n + choice). A stream
    sends each prompt's events in turn; a whole answer runs them at once, and all of them stop
    if one fails or the client goes away."""
    completions, caller = call.completions, call.caller
    key = raw_header(request.scope, _IDEMPOTENCY_HEADER)
    claim = await call.idempotency.claim(
        key, caller.key_id, shape.endpoint, body, prompts[0].stream
    )
    if prompts[0].stream:
        dispatches = await completions.dispatch_all(prompts, caller.admission())
        return event_stream(prompt_list_events(dispatches), dispatches)
    sites: list[str] = []

    async def run() -> Completion:
        dispatches = await completions.dispatch_all(prompts, caller.admission())
        answers = await unless_client_leaves(request.receive, collect_all(dispatches))
        sites.append(dispatches[-1].site.name)
        return merged_completion(answers, prompts[0].params.options.n)

    answered, replayed = await call.idempotency.once(claim, Completion, run)
    return Response(answered, headers=answer_headers(sites, replayed))


async def collect_all(dispatches: list[Dispatch]) -> list[Completion]:
    """Every prompt's answer, run at once; when one fails (or all are cancelled: the client
    left), the others stop at their sites too rather than generate what nobody will get."""
    running = [asyncio.ensure_future(collect_completion(d)) for d in dispatches]
    try:
        return await asyncio.gather(*running)
    except BaseException as exc:
        if not isinstance(exc, asyncio.CancelledError):
            for dispatch in dispatches:
                dispatch.cancel_reason = "another prompt of its request failed"
        for task in running:
            task.cancel()
        raise
