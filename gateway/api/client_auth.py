"""API-key authentication of the client APIs (/v1/...): the `caller` dependency, and a guard
for whole controllers or for endpoints that charge nothing (GET /v1/models).

Keys come as `Authorization: Bearer <key>`, which is what the openai clients send. The check
runs before the body is read, so a refused caller costs no parsing or tokenizing.
"""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.api.raw_headers import raw_header
from gateway.tenancy.admission import Caller, Tenancy

# Where the guard leaves the caller, so a handler that also asks for it looks the key up once.
_CALLER = "fedllm_caller"


async def _authenticate(connection: ASGIConnection[Any, Any, Any, Any]) -> Caller:
    known = connection.state.get(_CALLER)
    if isinstance(known, Caller):
        return known
    tenancy: Tenancy = connection.app.state.tenancy
    caller = await tenancy.authenticate(raw_header(connection.scope, b"authorization"))
    connection.state[_CALLER] = caller
    return caller


async def authenticate_caller(request: Request[Any, Any, Any]) -> Caller:
    """Litestar dependency `caller`: 401 (OpenAI-shaped `invalid_api_key`) unless allowed."""
    return await _authenticate(request)


async def require_client_key(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """Litestar guard: the same check as `caller`."""
    await _authenticate(connection)
