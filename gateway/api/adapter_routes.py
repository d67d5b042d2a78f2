"""LoRA adapters loaded and unloaded at run time (operators only; gateway/admin/adapters.py).

- POST /admin/api/adapters            {"name", "path", "parent", "site"?, "owner_key_id"?,
                                      "owner_key"?}: loads the adapter (a directory on the
                                      site's machine) on the site, or on every healthy site of
                                      `parent`, private to the key when one is given; 201
- DELETE /admin/api/adapters/{name}   unloads it from every site that serves it
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, delete, post
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.admin.adapters import AdapterAdmin, AdapterChangeView
from gateway.api.admin_auth import require_admin

AnyRequest = Request[Any, Any, Any]


class AdminAdaptersController(Controller):
    path = "/api"
    tags = ("admin",)
    guards = [require_admin]  # noqa: RUF012 (litestar's)

    @post("/adapters", status_code=201, summary="Load a LoRA adapter on the sites of its parent")
    async def load_adapter(
        self, request: AnyRequest, adapter_admin: NamedDependency[AdapterAdmin]
    ) -> AdapterChangeView:
        return await adapter_admin.load(adapter_admin.parse(await request.body()))

    @delete("/adapters/{name:str}", status_code=200, summary="Unload a LoRA adapter everywhere")
    async def unload_adapter(
        self, adapter_admin: NamedDependency[AdapterAdmin], name: FromPath[str]
    ) -> AdapterChangeView:
        return await adapter_admin.unload(name)
