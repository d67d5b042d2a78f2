"""Admin API for client keys (operators only): create, list, revoke, usage. A thin controller
over Tenancy and KeyService (gateway/tenancy/)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromQuery

from gateway.admin.adapters import AdapterAdmin
from gateway.api.admin_auth import require_admin
from gateway.api.body import decode_body
from gateway.api.key_schemas import (
    ApiKeyList,
    ApiKeyObject,
    ApiKeyUsage,
    CreatedApiKey,
    KeyCreateRequest,
    ModelUsageObject,
)
from gateway.api.openai_errors import OpenAIError, invalid_request
from gateway.api.openapi_body import json_body
from gateway.api.row_ids import row_id
from gateway.db.models import utcnow
from gateway.fine_tuning.service import FineTuningService
from gateway.request_path.service import CompletionService
from gateway.tenancy.admission import Tenancy
from gateway.tenancy.keys import KeyRecord

DEFAULT_USAGE_WINDOW_S = 24 * 3600
MAX_USAGE_WINDOW_S = 366 * 24 * 3600
# How long a usage read waits for the request log's queued writes (a few flush intervals).
USAGE_SETTLE_S = 2.0
KeyId = Annotated[int, row_id("key")]


def _fields(key: KeyRecord) -> dict[str, Any]:
    return {
        "id": key.id,
        "name": key.name,
        "prefix": key.prefix,
        "requests_per_minute": key.requests_per_minute,
        "tokens_per_minute": key.tokens_per_minute,
        "max_concurrent_requests": key.max_concurrent_requests,
        "created_at": int(key.created_at.timestamp()),
        "revoked_at": int(key.revoked_at.timestamp()) if key.revoked_at else None,
    }


def _not_found(key_id: int) -> OpenAIError:
    return OpenAIError(404, f"No API key with id {key_id}", param="id", code="api_key_not_found")


class AdminKeysController(Controller):
    path = "/admin/api/keys"
    tags = ("admin",)
    guards = [require_admin]  # noqa: RUF012 (litestar's)

    @post(
        "/",
        status_code=201,
        summary="Create a client API key (the key is shown only here)",
        operation_class=json_body(KeyCreateRequest),
    )
    async def create_key(
        self,
        request: Request[Any, Any, Any],
        tenancy: NamedDependency[Tenancy],
        adapter_admin: NamedDependency[AdapterAdmin],
    ) -> CreatedApiKey:
        body = decode_body(await request.body(), KeyCreateRequest)
        await adapter_admin.check_key_name(body.name)  # 409: adapters' owner names one key
        new = await tenancy.keys.create(
            body.name,
            body.requests_per_minute,
            body.tokens_per_minute,
            body.max_concurrent_requests,
        )
        await adapter_admin.key_made()
        return CreatedApiKey(**_fields(new.record), key=new.plaintext)

    @get("/", summary="Client API keys, revoked ones included")
    async def list_keys(self, tenancy: NamedDependency[Tenancy]) -> ApiKeyList:
        keys = await tenancy.keys.list_keys()
        return ApiKeyList(data=[ApiKeyObject(**_fields(key)) for key in keys])

    @delete("/{key_id:int}", status_code=200, summary="Revoke a key (at once)")
    async def revoke_key(self, tenancy: NamedDependency[Tenancy], key_id: KeyId) -> ApiKeyObject:
        key = await tenancy.revoke(key_id)
        if key is None:
            raise _not_found(key_id)
        return ApiKeyObject(**_fields(key))

    @get("/{key_id:int}/usage", summary="Requests and tokens of a key over the last window_s")
    async def key_usage(
        self,
        tenancy: NamedDependency[Tenancy],
        completions: NamedDependency[CompletionService],
        fine_tuning: NamedDependency[FineTuningService],
        key_id: KeyId,
        window_s: FromQuery[int] = DEFAULT_USAGE_WINDOW_S,
    ) -> ApiKeyUsage:
        if not 1 <= window_s <= MAX_USAGE_WINDOW_S:
            raise invalid_request(f"window_s must be in 1..{MAX_USAGE_WINDOW_S}", param="window_s")
        if await tenancy.keys.get(key_id) is None:
            raise _not_found(key_id)
        # The request log is written behind the answers: what was answered before this call
        # is counted (unless the database refuses writes: then what it holds so far).
        await completions.records.writer.settle(USAGE_SETTLE_S)
        since = utcnow() - timedelta(seconds=window_s)
        usage = await tenancy.keys.usage(key_id, since)
        return ApiKeyUsage(
            api_key_id=key_id,
            window_s=window_s,
            since=int(usage.since.timestamp()),
            requests=usage.requests,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            models=[
                ModelUsageObject(
                    m.model,
                    m.adapter,
                    m.requests,
                    m.prompt_tokens,
                    m.completion_tokens,
                    m.prompt_tokens + m.completion_tokens,
                )
                for m in usage.models
            ],
            trained_tokens=await fine_tuning.store.trained_tokens(key_id, since),
        )
