"""The operator credential: a guard for /admin, the admin API and /metrics.

A request is an operator's when it carries `Authorization: Bearer <GATEWAY_ADMIN_TOKEN>` or a
live dashboard session cookie. The cookie is `<session id>.<issue time>.<HMAC of both under the
admin token>`: it never holds the token, it cannot be minted without the token, it expires on
the server SESSION_MAX_AGE_S after issue whatever the browser keeps, rotating the token voids
every cookie, and its session row (gateway/stores/admin_sessions.py) makes logout revoke it on
every gateway sharing the database. Comparisons are constant-time. Without a configured token
every operator endpoint answers 401.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.api.openai_errors import OpenAIError
from gateway.stores.admin_sessions import AdminSessionStore
from gateway.stores.login_failures import LoginFailureStore

ADMIN_COOKIE = "fedllm_admin"
_COOKIE_CONTEXT = b"fedllm admin session v2"
# Failed sign-ins one client address may make per window before it must wait.
LOGIN_FAILURES_PER_WINDOW = 5
LOGIN_WINDOW_S = 60.0


def _signature(admin_token: str, session_id: str, issued_at: int) -> str:
    message = b"|".join((_COOKIE_CONTEXT, session_id.encode(), str(issued_at).encode()))
    return hmac.new(admin_token.encode(), message, hashlib.sha256).hexdigest()


def new_session_id() -> str:
    return secrets.token_hex(24)


def session_cookie(admin_token: str, session_id: str, issued_at: int) -> str:
    return f"{session_id}.{issued_at}.{_signature(admin_token, session_id, issued_at)}"


def cookie_session(
    admin_token: str, cookie: str | None, now: float, max_age_s: float
) -> str | None:
    """The session id a cookie signed with `admin_token` names, if it is not yet expired."""
    session_id, _, rest = (cookie or "").partition(".")
    issued, _, signature = rest.partition(".")
    if not (session_id and issued.isdigit() and signature):
        return None
    expected = _signature(admin_token, session_id, int(issued))
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return None
    return session_id if 0 <= now - int(issued) < max_age_s else None


def bearer_is_admin(admin_token: str | None, authorization: str | None) -> bool:
    if not admin_token:
        return False
    scheme, _, credential = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credential.strip().encode(), admin_token.encode()
    )


@dataclass(frozen=True, slots=True)
class AdminAccess:
    """What the operator credential is checked against (app.state.admin_access)."""

    # GATEWAY_ADMIN_TOKEN; None: every operator endpoint answers 401.
    token: str | None = field(repr=False)
    session_ttl_s: float
    # Where the gateway listens: off loopback, the session cookie is always Secure.
    host: str
    sessions: AdminSessionStore
    # Failed sign-ins, counted across the gateways of the database.
    login_throttle: LoginThrottle


def admin_access(connection: ASGIConnection[Any, Any, Any, Any]) -> AdminAccess:
    access: AdminAccess = connection.app.state.admin_access
    return access


async def is_operator(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    access = admin_access(connection)
    admin_token = access.token
    if not admin_token:
        return False
    if bearer_is_admin(admin_token, connection.headers.get("authorization")):
        return True
    session_id = cookie_session(
        admin_token, connection.cookies.get(ADMIN_COOKIE), time.time(), access.session_ttl_s
    )
    return session_id is not None and bool(await access.sessions.is_live(session_id))


def unauthorized() -> OpenAIError:
    return OpenAIError(
        401,
        "this endpoint needs the admin credential (Authorization: Bearer <GATEWAY_ADMIN_TOKEN>)",
        type="authentication_error",
        code="admin_credential_required",
    )


async def require_admin(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """Litestar guard: raises 401 (OpenAI-shaped) unless the caller is an operator."""
    if not await is_operator(connection):
        raise unauthorized()


@dataclass(frozen=True, slots=True)
class LoginThrottle:
    """Failed sign-ins per client address over a sliding window, counted in the database by
    every gateway sharing it (a guesser spreading attempts over replicas is held all the same).
    Behind a load balancer the address is the balancer's own unless it is the only hop
    operators use; the admin paths are reachable only from the operators' networks there
    (infra/terraform)."""

    failures: LoginFailureStore
    limit: int = LOGIN_FAILURES_PER_WINDOW
    window_s: float = LOGIN_WINDOW_S

    async def retry_after_s(self, address: str, now: datetime) -> float | None:
        """None while `address` may try; else how long until the oldest of its last `limit`
        failures leaves the window."""
        window = timedelta(seconds=self.window_s)
        recent = await self.failures.recent(address, now - window, self.limit)
        if len(recent) < self.limit:
            return None
        return max((recent[-1] + window - now).total_seconds(), 0.0)

    async def failed(self, address: str, now: datetime) -> None:
        await self.failures.failed(address, now, timedelta(seconds=self.window_s))

    async def succeeded(self, address: str) -> None:
        await self.failures.succeeded(address)
