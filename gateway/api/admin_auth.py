"""The operator credential: a guard for /admin, the admin API and /metrics.

A request is an operator's when it carries `Authorization: Bearer <GATEWAY_ADMIN_TOKEN>` or a
live dashboard session cookie. The cookie is `<session id>.<issue time>.<HMAC of both under the
admin token>`: it never holds the token, it cannot be minted without the token, it expires on
the server SESSION_MAX_AGE_S after issue whatever the browser keeps, rotating the token voids
every cookie, and its session row (gateway/services/admin_sessions.py) makes logout revoke it on
every gateway sharing the database. Comparisons are constant-time. Without a configured token
every operator endpoint answers 401.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.api.errors import OpenAIError

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


async def is_operator(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    runtime = connection.app.state.runtime
    admin_token: str | None = runtime.settings.admin_token
    if not admin_token:
        return False
    if bearer_is_admin(admin_token, connection.headers.get("authorization")):
        return True
    session_id = cookie_session(
        admin_token,
        connection.cookies.get(ADMIN_COOKIE),
        time.time(),
        runtime.settings.admin_session_ttl_s,
    )
    return session_id is not None and bool(await runtime.admin_sessions.is_live(session_id))


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


@dataclass(slots=True)
class LoginThrottle:
    """Failed sign-ins per client address over a sliding window, in this process. Behind a load
    balancer the address is the balancer's own unless it is the only hop operators use; the
    admin paths are reachable only from the operators' networks there (infra/terraform)."""

    limit: int = LOGIN_FAILURES_PER_WINDOW
    window_s: float = LOGIN_WINDOW_S
    max_addresses: int = 10_000
    _failures: dict[str, deque[float]] = field(default_factory=dict)

    def retry_after_s(self, address: str, now: float) -> float | None:
        """None while `address` may try; else how long until its oldest failure leaves."""
        failures = self._failures.get(address)
        while failures and now - failures[0] >= self.window_s:
            failures.popleft()
        if not failures:
            self._failures.pop(address, None)
            return None
        return self.window_s - (now - failures[0]) if len(failures) >= self.limit else None

    def failed(self, address: str, now: float) -> None:
        if address not in self._failures and len(self._failures) >= self.max_addresses:
            for known in list(self._failures):  # forget addresses whose failures expired
                self.retry_after_s(known, now)
            while len(self._failures) >= self.max_addresses:  # then the longest known
                del self._failures[next(iter(self._failures))]
        self._failures.setdefault(address, deque()).append(now)

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)
