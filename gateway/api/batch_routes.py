"""/v1/batches: a thin controller over BatchService (gateway/batches/service.py), as the openai
clients call it (batches.create, retrieve, list, cancel), plus the inline form and per-item
results of this gateway."""

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
    BatchCreateSchema,
    BatchList,
    BatchProgress,
    BatchResult,
    BatchResultList,
    BatchUsage,
    InputTokensDetails,
    ItemAssignment,
    RequestCounts,
)
from gateway.api.body import decode_body
from gateway.api.client_auth import require_client_key
from gateway.api.openai_errors import ErrorBody, OpenAIError
from gateway.api.openapi_body import json_body
from gateway.batches.records import BatchView, ItemView
from gateway.batches.service import BatchService
from gateway.db.models import BatchStatus
from gateway.files.service import FileService
from gateway.idempotency import HEADER, REPLAYED_HEADER, Idempotency
from gateway.settings import GatewaySettings
from gateway.tenancy.admission import Caller

DEFAULT_BATCH_PAGE, DEFAULT_RESULT_PAGE = 20, 100


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def batch_object(view: BatchView) -> Batch:
    finished = _unix(view.finished_at)

    def ended(status: BatchStatus) -> int | None:
        return finished if view.status == status else None

    return Batch(
        id=view.id,
        endpoint=view.endpoint,
        input_file_id=view.input_file_id,
        completion_window=view.completion_window,
        model=view.model,
        status=view.status.value,
        created_at=int(view.created_at.timestamp()),
        request_counts=RequestCounts(view.total, view.completed, view.failed),
        metadata=view.metadata,
        output_file_id=view.output_file_id,
        error_file_id=view.error_file_id,
        in_progress_at=_unix(view.in_progress_at),
        expires_at=_unix(view.expires_at),
        finalizing_at=_unix(view.finalizing_at),
        completed_at=ended(BatchStatus.COMPLETED),
        failed_at=ended(BatchStatus.FAILED),
        expired_at=_unix(view.expired_at) if view.status == BatchStatus.EXPIRED else None,
        cancelling_at=_unix(view.cancelling_at),
        cancelled_at=ended(BatchStatus.CANCELLED),
        usage=BatchUsage(
            view.usage.input_tokens,
            view.usage.output_tokens,
            view.usage.input_tokens + view.usage.output_tokens,
            InputTokensDetails(view.usage.cached_input_tokens),
        ),
        progress=None
        if view.progress is None
        else BatchProgress(
            view.progress.planned_tokens,
            view.progress.finished_tokens,
            round(view.progress.fraction, 4),
            None if view.progress.eta_s is None else round(view.progress.eta_s, 1),
        ),
    )


def _result(item: ItemView) -> BatchResult:
    return BatchResult(
        custom_id=item.custom_id,
        status=item.status.value,
        assignment=ItemAssignment(item.site, item.predicted_tokens, item.assign_reason),
        response=item.completion,
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
        summary="Create a batch: from an uploaded JSONL file (OpenAI's form) or inline",
        operation_class=json_body(BatchCreateSchema),
    )
    async def create_batch(
        self,
        request: Request[Any, Any, Any],
        batches: NamedDependency[BatchService],
        files: NamedDependency[FileService],
        idempotency: NamedDependency[Idempotency],
        settings: NamedDependency[GatewaySettings],
        caller: NamedDependency[Caller],
    ) -> Response[Batch]:
        # Counted with file uploads: validating a batch tokenizes every one of its requests.
        with files.uploads.admit(caller.key_id):
            body = await _read_body(request, settings.batches.max_body_bytes)
            async with files.uploads.validating():
                batch = decode_body(body, BatchCreateRequest)
                claim = await idempotency.claim(
                    request.headers.get(HEADER), caller.key_id, "/v1/batches", body, stream=False
                )

                async def submit() -> Batch:
                    key_name = caller.key.name if caller.key is not None else None
                    view = await batches.submit(batch, caller.key_id, caller.admit_batch, key_name)
                    return batch_object(view)

                # A replay answers with the batch as it was created (same id); GET it for
                # progress.
                created, replayed = await idempotency.once(claim, Batch, submit)
        return Response(created, headers={REPLAYED_HEADER: "true"} if replayed else {})

    @get("/", summary="The caller's batches, newest first")
    async def list_batches(
        self,
        batches: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = DEFAULT_BATCH_PAGE,
    ) -> BatchList:
        page = await batches.list_batches(caller.key_id, after, limit)
        data = [batch_object(view) for view in page.data]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return BatchList(data=data, first_id=first, last_id=last, has_more=page.has_more)

    @get("/{batch_id:str}", summary="A batch and its request counts")
    async def get_batch(
        self,
        batches: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
        batch_id: FromPath[str],
    ) -> Batch:
        return batch_object(await batches.get(batch_id, caller.key_id))

    @post("/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch")
    async def cancel_batch(
        self,
        batches: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
        batch_id: FromPath[str],
    ) -> Batch:
        return batch_object(await batches.cancel(batch_id, caller.key_id))

    @get(
        "/{batch_id:str}/results",
        summary="Each request's outcome and assignment, in submission order (an extension)",
    )
    async def batch_results(
        self,
        batches: NamedDependency[BatchService],
        caller: NamedDependency[Caller],
        batch_id: FromPath[str],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = DEFAULT_RESULT_PAGE,
    ) -> BatchResultList:
        page = await batches.results(batch_id, caller.key_id, after, limit)
        data = [_result(item) for item in page.data]
        first, last = (data[0].custom_id, data[-1].custom_id) if data else (None, None)
        return BatchResultList(data=data, first_id=first, last_id=last, has_more=page.has_more)
