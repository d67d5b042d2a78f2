"""What the federation is working on, for the dashboard's Batches panel (operators only).

- GET /admin/api/batches?limit             every owner's batches not yet final, as /v1/batches
                                           shows them (request counts, `progress` with its ETA)
- GET /admin/api/adapters?window_s         requests and tokens per LoRA adapter over the window
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, get
from litestar.di import NamedDependency
from litestar.params import Parameter

from gateway.admin.dashboard import Dashboard
from gateway.api.admin_auth import require_admin
from gateway.api.admin_routes import WindowS, json_response, window_of
from gateway.api.batch_routes import batch_object
from gateway.api.batch_schemas import Batch
from gateway.batches.service import BatchService

AnyRequest = Request[Any, Any, Any]


class OpenBatches(msgspec.Struct, frozen=True):
    data: list[Batch]


class AdapterLoadView(msgspec.Struct, frozen=True):
    model: str
    adapter: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


class AdapterLoads(msgspec.Struct, frozen=True):
    window_s: int
    adapters: list[AdapterLoadView]


class AdminWorkloadController(Controller):
    path = "/api"
    tags = ("admin",)
    guards = [require_admin]  # noqa: RUF012 (litestar's)

    @get("/batches", summary="Batches not yet final, with their progress and ETA")
    async def open_batches(
        self,
        request: AnyRequest,
        batches: NamedDependency[BatchService],
        limit: Annotated[int, Parameter(ge=1, le=1000)] = 100,
    ) -> Response[bytes]:
        views = await batches.open_batches(limit)
        return json_response(request, OpenBatches([batch_object(view) for view in views]))

    @get("/adapters", summary="Requests and tokens per LoRA adapter over the window")
    async def adapters(
        self, request: AnyRequest, dashboard: NamedDependency[Dashboard], window_s: WindowS = 86400
    ) -> Response[bytes]:
        window_of(dashboard, window_s, None)  # 400 past the retention, as the other panels
        rows = await dashboard.adapter_load(window_s)
        views = [
            AdapterLoadView(r.model, r.adapter, r.requests, r.prompt_tokens, r.completion_tokens)
            for r in rows
        ]
        return json_response(request, AdapterLoads(window_s, views))
