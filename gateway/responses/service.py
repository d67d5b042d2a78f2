"""The Responses API over the chat machinery: a request becomes the chat request it amounts to
(gateway/responses/to_chat.py), is prepared by ChatService and dispatched by CompletionService
like any chat request (routed, length-predicted, admitted, charged to its key, recorded in the
request log with api "responses", continued elsewhere if its site fails), and its answer is
shaped into the Responses API's output items.

Stored responses (`store` left on) belong to the key that made them: `previous_response_id`,
GET, DELETE and input_items see only the caller's own, and another key's reads as unknown
(404), as a response stored with `store: false` (never written) or past its retention.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import msgspec
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from gateway.batch_settings import ResponseSettings
from gateway.chat.service import ChatService
from gateway.completions.sampling_options import served_tier
from gateway.db.models import utcnow
from gateway.dispatch.request import PreparedCompletion
from gateway.errors import GatewayError, NotFound, Unavailable, invalid_request
from gateway.responses.items import Item, input_items, items_from_json
from gateway.responses.request import ResponseCreateRequest
from gateway.responses.result import ResponseObject
from gateway.responses.to_chat import chat_request
from gateway.responses.unsupported import reject_unsupported
from gateway.stores.expiry import purge_forever
from gateway.stores.pages import Owner, Page
from gateway.stores.response_store import NewResponse, ResponseStore

log = logging.getLogger(__name__)
MAX_ITEMS_PAGE = 100
Order = Literal["asc", "desc"]


def response_not_found(response_id: str, param: str = "response_id") -> GatewayError:
    return NotFound(
        f"No response with id '{response_id}' found.", param=param, code="response_not_found"
    )


@dataclass(frozen=True, slots=True)
class ResponsePlan:
    """A prepared Responses request: the completion to dispatch, the response it will answer
    with (less its output), and what storing it keeps."""

    prepared: PreparedCompletion
    draft: ResponseObject
    owner: Owner
    input_items: list[Item]
    history: list[Item] = field(default_factory=list)


def _echo_text(text: dict[str, Any] | None) -> dict[str, Any]:
    fmt = (text or {}).get("format") or {"type": "text"}
    return {"format": fmt, "verbosity": "medium"}


def _draft(req: ResponseCreateRequest, prepared: PreparedCompletion) -> ResponseObject:
    return ResponseObject(
        id=prepared.request_id,
        created_at=prepared.created,
        model=req.model,
        status="in_progress",
        output=[],
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        max_tool_calls=req.max_tool_calls,
        metadata=dict(req.metadata or {}),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        prompt_cache_key=req.prompt_cache_key,
        safety_identifier=req.safety_identifier,
        # The tier it is served in, as OpenAI answers it.
        service_tier=served_tier(prepared.params.options.priority),
        store=req.store is not False,
        temperature=1.0 if req.temperature is None else req.temperature,
        text=_echo_text(req.text),
        tool_choice=req.tool_choice or "auto",
        tools=list(req.tools or []),
        top_p=1.0 if req.top_p is None else req.top_p,
        user=req.user,
    )


def _database_unavailable() -> GatewayError:
    return Unavailable(
        "the gateway's database is unavailable, so the response could not be stored; retry shortly",
        code="database_unavailable",
        retry_after_s=1,
    )


class ResponsesService:
    def __init__(self, chat: ChatService, store: ResponseStore, settings: ResponseSettings) -> None:
        self._chat = chat
        self._store = store
        self._retention = timedelta(hours=settings.retention_h)

    async def earlier(self, req: ResponseCreateRequest, owner: Owner) -> list[Item]:
        """The conversation `previous_response_id` continues: that response's earlier items,
        its input and its output (404 when the caller has no such stored response)."""
        previous = req.previous_response_id
        if previous is None:
            return []
        record = await self._store.get(previous, owner)
        if record is None:
            raise response_not_found(previous, param="previous_response_id")
        output = record.response.get("output", [])
        return items_from_json([*record.history, *record.input_items, *output])

    def prepare(
        self, req: ResponseCreateRequest, earlier: list[Item], owner: Owner
    ) -> ResponsePlan:
        """Validates, renders and tokenizes (on the tokenize pool); a 400 changes nothing."""
        reject_unsupported(req)
        items = input_items(req.input)
        chat, params = chat_request(req, earlier, items)
        try:
            prepared = self._chat.prepare(chat, api="responses")
        except GatewayError as exc:
            raise params.renamed(exc) from None
        return ResponsePlan(prepared, _draft(req, prepared), owner, items, earlier)

    async def save(self, plan: ResponsePlan, response: ResponseObject) -> None:
        """Stores the finished response unless the client asked not to."""
        if not response.store:
            return
        new = NewResponse(
            id=response.id,
            owner=plan.owner,
            model=response.model,
            expires_at=utcnow() + self._retention,
            response=msgspec.to_builtins(response),
            input_items=msgspec.to_builtins(plan.input_items),
            history=msgspec.to_builtins(plan.history),
        )
        try:
            await self._store.add(new)
        except (OperationalError, InterfaceError, PoolTimeoutError) as exc:
            log.warning("responses: storing %s failed: %s", response.id, exc)
            raise _database_unavailable() from exc

    async def get(self, response_id: str, owner: Owner) -> ResponseObject:
        record = await self._store.get(response_id, owner)
        if record is None:
            raise response_not_found(response_id)
        return msgspec.convert(record.response, ResponseObject)

    async def delete(self, response_id: str, owner: Owner) -> None:
        if not await self._store.delete(response_id, owner):
            raise response_not_found(response_id)

    async def input_items(
        self, response_id: str, owner: Owner, after: str | None, limit: int, order: Order
    ) -> Page[Item]:
        """The response's own input items, a page at a time (OpenAI's default: newest first)."""
        if not 1 <= limit <= MAX_ITEMS_PAGE:
            raise invalid_request(f"limit must be in 1..{MAX_ITEMS_PAGE}", param="limit")
        record = await self._store.get(response_id, owner)
        if record is None:
            raise response_not_found(response_id)
        items = items_from_json(record.input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.id for item in items]
            if after not in ids:
                raise invalid_request(f"after: no input item with id '{after}'", param="after")
            items = items[ids.index(after) + 1 :]
        return Page(items[:limit], has_more=len(items) > limit)

    async def delete_expired_forever(self) -> None:
        """Deletes expired responses now and every few minutes (a background task)."""
        await purge_forever(self._store.delete_expired, "responses", "retention", log)
