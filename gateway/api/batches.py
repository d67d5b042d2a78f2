"""/v1/batches: a thin controller over BatchService (gateway/batches.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from gateway.api.batch_schemas import (
    Batch,
    BatchCreateRequest,
    BatchList,
    BatchResult,
    BatchResultList,
    ItemAssignment,
    RequestCounts,
)
from gateway.api.body import decode_body
from gateway.api.client_auth import require_client_key
from gateway.api.errors import ErrorBody, OpenAIError
from gateway.api.openapi_body import json_body
from gateway.api.schemas import Completion
from gateway.db.models import BatchStatus
from gateway.idempotency import HEADER, REPLAYED_HEADER
from gateway.runtime import GatewayRuntime
from gateway.services.batch_records import BatchView, ItemView
from gateway.tenancy.admission import Caller

DEFAULT_BATCH_PAGE, DEFAULT_RESULT_PAGE = 20, 100


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def _batch(view: BatchView) -> Batch:
    finished = _unix(view.finished_at)
    return Batch(
        id=view.id,
        model=view.model,
        status=view.status.value,
        created_at=int(view.created_at.timestamp()),
        request_counts=RequestCounts(view.total, view.completed, view.failed),
        metadata=view.metadata,
        in_progress_at=_unix(view.in_progress_at),
        completed_at=finished if view.status == BatchStatus.COMPLETED else None,
        failed_at=finished if view.status == BatchStatus.FAILED else None,
        cancelling_at=_unix(view.cancelling_at),
        cancelled_at=finished if view.status == BatchStatus.CANCELLED else None,
    )


def _result(item: ItemView) -> BatchResult:
    return BatchResult(
        custom_id=item.custom_id,
        status=item.status.value,
        assignment=ItemAssignment(item.site, item.predicted_tokens, item.assign_reason),
        response=msgspec.convert(item.completion, Completion) if item.completion else None,
        error=msgspec.convert(item.error, ErrorBody) if item.error else None,
    )


async def _read_body(request: Request[Any, Any, Any], limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (batches get their own, larger limit)."""
    too_large = OpenAIError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


class BatchesController(Controller):
    path = "/v1/batches"
    tags = ("batches",)
    guards = [require_client_key]  # noqa: RUF012 (litestar's layered attribute)

    @post(
        "/",
        status_code=200,
        request_max_body_size=None,  # checked against GATEWAY_BATCH_MAX_BODY_BYTES instead
        summary="Submit a batch of completion requests, run offline",
        operation_class=json_body(BatchCreateRequest),
    )
    async def create_batch(
        self,
        request: Request[Any, Any, Any],
        runtime: NamedDependency[GatewayRuntime],
        caller: NamedDependency[Caller],
    ) -> Response[Batch]:
        body = await _read_body(request, runtime.settings.batch_max_body_bytes)
        batch = decode_body(body, BatchCreateRequest)
        claim = await runtime.idempotency.claim(
            request.headers.get(HEADER), caller.key_id, "/v1/batches", body, stream=False
        )

        async def submit() -> Batch:
            return _batch(await runtime.batches.submit(batch, caller.admit_batch))

        # A replay answers with the batch as it was created (same id); GET it for its progress.
        created, replayed = await runtime.idempotency.once(claim, Batch, submit)
        return Response(created, headers={REPLAYED_HEADER: "true"} if replayed else {})

    @get("/", summary="Batches, newest first")
    async def list_batches(
        self,
        runtime: NamedDependency[GatewayRuntime],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = DEFAULT_BATCH_PAGE,
    ) -> BatchList:
        page = await runtime.batches.list_batches(after, limit)
        data = [_batch(view) for view in page.data]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return BatchList(data=data, first_id=first, last_id=last, has_more=page.has_more)

    @get("/{batch_id:str}", summary="A batch and its request counts")
    async def get_batch(
        self, runtime: NamedDependency[GatewayRuntime], batch_id: FromPath[str]
    ) -> Batch:
        return _batch(await runtime.batches.get(batch_id))

    @post("/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch")
    async def cancel_batch(
        self, runtime: NamedDependency[GatewayRuntime], batch_id: FromPath[str]
    ) -> Batch:
        return _batch(await runtime.batches.cancel(batch_id))

    @get("/{batch_id:str}/results", summary="Each request's outcome, in submission order")
    async def batch_results(
        self,
        runtime: NamedDependency[GatewayRuntime],
        batch_id: FromPath[str],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = DEFAULT_RESULT_PAGE,
    ) -> BatchResultList:
        page = await runtime.batches.results(batch_id, after, limit)
        data = [_result(item) for item in page.data]
        first, last = (data[0].custom_id, data[-1].custom_id) if data else (None, None)
        return BatchResultList(data=data, first_id=first, last_id=last, has_more=page.has_more)
