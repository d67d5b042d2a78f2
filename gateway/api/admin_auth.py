"""The operator credential: a guard for /admin, the admin API and /metrics.

A request is an operator's when it carries `Authorization: Bearer <GATEWAY_ADMIN_TOKEN>` or the
dashboard's session cookie. The cookie holds an HMAC of the token, never the token itself, so a
leaked cookie does not reveal the credential and rotating the token invalidates every session.
Comparisons are constant-time. Without a configured token every operator endpoint answers 401.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.api.errors import OpenAIError

ADMIN_COOKIE = "fedllm_admin"
_COOKIE_CONTEXT = b"fedllm admin session v1"


def session_value(admin_token: str) -> str:
    """The cookie value that proves knowledge of `admin_token`."""
    return hmac.new(admin_token.encode(), _COOKIE_CONTEXT, hashlib.sha256).hexdigest()


def is_admin(admin_token: str | None, authorization: str | None, cookie: str | None) -> bool:
    if not admin_token:
        return False
    scheme, _, credential = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(
        credential.strip().encode(), admin_token.encode()
    ):
        return True
    return cookie is not None and hmac.compare_digest(
        cookie.encode(), session_value(admin_token).encode()
    )


def unauthorized() -> OpenAIError:
    return OpenAIError(
        401,
        "this endpoint needs the admin credential (Authorization: Bearer <GATEWAY_ADMIN_TOKEN>)",
        type="authentication_error",
        code="admin_credential_required",
    )


def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Litestar guard: raises 401 (OpenAI-shaped) unless the caller is an operator."""
    settings = connection.app.state.runtime.settings
    if not is_admin(
        settings.admin_token,
        connection.headers.get("authorization"),
        connection.cookies.get(ADMIN_COOKIE),
    ):
        raise unauthorized()
