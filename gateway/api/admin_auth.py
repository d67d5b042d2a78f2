"""The operator credential: a guard for /admin, the admin API and /metrics; and the read-only
metrics credential (GATEWAY_ADMIN_METRICS_TOKEN), which opens /metrics alone, so that a scraper
(Prometheus, in deploy/k8s) never holds the admin token.

A request is an operator's when it carries `Authorization: Bearer <GATEWAY_ADMIN_TOKEN>` or a
live dashboard session cookie. The cookie is `<session id>.<issue time>.<HMAC of both under the
admin token>`: it never holds the token, it cannot be minted without the token, it expires on
the server SESSION_MAX_AGE_S after issue whatever the browser keeps, rotating the token voids
every cookie, and its session row (gateway/stores/admin_sessions.py) makes logout revoke it on
every gateway sharing the database. Comparisons are constant-time. Without a configured token
every operator endpoint answers 401.

Guessing: every wrong admin credential counts, a sign-in or a bearer token on the admin API and
/metrics alike: LOGIN_FAILURES_PER_WINDOW a minute per client, on every gateway of the database,
then 429 without the credential being looked at (else a guess's answer would tell right from
wrong). A client is its address, unless it carries a device cookie: a browser that signed in
once gets one (`<device id>.<issue time>.<HMAC>`, DEVICE_TTL_S), and its failures then count on
their own, so whoever shares the operator's address cannot lock the operator out (OWASP's
"device cookies"). Cookies are not credentials one can guess and are never counted.

Cross-site requests: an admin request that changes something (POST, PUT, PATCH, DELETE) with
an `Origin` other than the gateway's own gets 403, and one whose body is not JSON 415 (the
sign-in form excepted), on top of the SameSite=Strict cookies: a page elsewhere cannot make an
operator's browser act.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.api.openai_errors import OpenAIError
from gateway.stores.admin_sessions import AdminSessionStore
from gateway.stores.login_failures import LoginFailureStore

ADMIN_COOKIE = "fedllm_admin"
_COOKIE_CONTEXT = b"fedllm admin session v2"
DEVICE_COOKIE = "fedllm_admin_device"
_DEVICE_CONTEXT = b"fedllm admin device v1"
# How long a browser that signed in keeps its own count of failed sign-ins.
DEVICE_TTL_S = 30 * 24 * 3600
# Failed admin credentials one client may offer per window before it must wait.
LOGIN_FAILURES_PER_WINDOW = 5
LOGIN_WINDOW_S = 60.0
_UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _signature(admin_token: str, name: str, issued_at: int, context: bytes) -> str:
    message = b"|".join((context, name.encode(), str(issued_at).encode()))
    return hmac.new(admin_token.encode(), message, hashlib.sha256).hexdigest()


def _signed(admin_token: str, name: str, issued_at: int, context: bytes) -> str:
    return f"{name}.{issued_at}.{_signature(admin_token, name, issued_at, context)}"


def _verified(
    admin_token: str, cookie: str | None, now: float, max_age_s: float, context: bytes
) -> str | None:
    """The name a cookie signed with `admin_token` under `context` carries, if not expired."""
    name, _, rest = (cookie or "").partition(".")
    issued, _, signature = rest.partition(".")
    if not (name and issued.isdigit() and signature):
        return None
    expected = _signature(admin_token, name, int(issued), context)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return None
    return name if 0 <= now - int(issued) < max_age_s else None


def new_session_id() -> str:
    return secrets.token_hex(24)


def session_cookie(admin_token: str, session_id: str, issued_at: int) -> str:
    return _signed(admin_token, session_id, issued_at, _COOKIE_CONTEXT)


def cookie_session(
    admin_token: str, cookie: str | None, now: float, max_age_s: float
) -> str | None:
    """The session id a cookie signed with `admin_token` names, if it is not yet expired."""
    return _verified(admin_token, cookie, now, max_age_s, _COOKIE_CONTEXT)


def device_cookie(admin_token: str, issued_at: int) -> str:
    """A new device cookie: a random id, signed."""
    return _signed(admin_token, secrets.token_hex(16), issued_at, _DEVICE_CONTEXT)


def cookie_device(admin_token: str, cookie: str | None, now: float) -> str | None:
    return _verified(admin_token, cookie, now, DEVICE_TTL_S, _DEVICE_CONTEXT)


def bearer_is_admin(admin_token: str | None, authorization: str | None) -> bool:
    """Whether `authorization` is `Bearer <admin_token>` (any token: the metrics one too)."""
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
    # GATEWAY_ADMIN_METRICS_TOKEN: /metrics alone; None: /metrics takes the admin credential.
    metrics_token: str | None = field(default=None, repr=False)


def admin_access(connection: ASGIConnection[Any, Any, Any, Any]) -> AdminAccess:
    access: AdminAccess = connection.app.state.admin_access
    return access


def guesser(connection: ASGIConnection[Any, Any, Any, Any], admin_token: str | None) -> str:
    """Whom failed admin credentials are counted against: the browser's device, if it carries
    a device cookie of this token, else the client's address (always, without an admin token:
    no cookie can be signed then)."""
    if admin_token:
        device = cookie_device(admin_token, connection.cookies.get(DEVICE_COOKIE), time.time())
        if device is not None:
            return f"device:{device}"
    return connection.client.host if connection.client is not None else "unknown"


def credential_throttled(wait_s: float) -> OpenAIError:
    return OpenAIError(
        429,
        "too many wrong admin credentials from this client; wait before trying again",
        type="authentication_error",
        code="admin_credential_throttled",
        retry_after_s=max(1, math.ceil(wait_s)),
    )


async def is_operator(
    connection: ASGIConnection[Any, Any, Any, Any], *, also: str | None = None
) -> bool:
    """A live session cookie, or the right bearer token (the admin token, or `also`: the
    metrics token where the route takes it); a wrong bearer token is counted against its
    client, and a client over its count gets 429 (raised) unheard, whichever token it guesses."""
    access = admin_access(connection)
    admin_token = access.token
    if admin_token:
        session_id = cookie_session(
            admin_token, connection.cookies.get(ADMIN_COOKIE), time.time(), access.session_ttl_s
        )
        if session_id is not None and await access.sessions.is_live(session_id):
            return True
    tokens = [token for token in (admin_token, also) if token]
    authorization = connection.headers.get("authorization")
    if not tokens or authorization is None:
        return False
    who, now = guesser(connection, admin_token), datetime.now(UTC)
    wait_s = await access.login_throttle.retry_after_s(who, now)
    if wait_s is not None:
        raise credential_throttled(wait_s)
    if any(bearer_is_admin(token, authorization) for token in tokens):
        return True
    await access.login_throttle.failed(who, now)
    return False


def _netloc(scheme: str, host: str) -> str:
    """host[:port] without the scheme's default port, lower-cased."""
    name, _, port = host.lower().rpartition(":")
    if not name or not port.isdigit():  # no port (or an IPv6 address without one)
        return host.lower()
    return name if _DEFAULT_PORTS.get(scheme) == port else host.lower()


def same_origin(origin: str, host: str | None) -> bool:
    """Whether a browser's `Origin` is the gateway itself (the Host it was asked for)."""
    parts = urlsplit(origin)
    if parts.scheme not in _DEFAULT_PORTS or not parts.netloc or host is None:
        return False
    return _netloc(parts.scheme, parts.netloc) in (
        _netloc("http", host),
        _netloc("https", host),
    )


def refuse_cross_site(connection: ASGIConnection[Any, Any, Any, Any], json_body: bool) -> None:
    """403 for a request that changes something sent from another origin; with `json_body`,
    415 for one whose body is not JSON (what a cross-site form can send without asking)."""
    if connection.scope.get("method") not in _UNSAFE_METHODS:
        return
    headers = connection.headers
    origin = headers.get("origin")
    if origin is not None and not same_origin(origin, headers.get("host")):
        raise OpenAIError(
            403,
            f"admin changes are refused from another origin ({origin[:100]})",
            type="permission_error",
            code="cross_origin_refused",
        )
    has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
    media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    if json_body and has_body and media_type != "application/json":
        raise OpenAIError(
            415,
            "admin API bodies are JSON: send Content-Type: application/json",
            code="unsupported_media_type",
        )


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
    """Litestar guard: raises 401 (OpenAI-shaped) unless the caller is an operator (403/415 for
    a cross-site change, 429 for a client over its count of wrong credentials)."""
    refuse_cross_site(connection, json_body=True)
    if not await is_operator(connection):
        raise unauthorized()


async def require_metrics_reader(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """Litestar guard of /metrics: the admin credential or the read-only metrics token."""
    if not await is_operator(connection, also=admin_access(connection).metrics_token):
        raise OpenAIError(
            401,
            "this endpoint needs the metrics or admin credential (Authorization: Bearer "
            "<GATEWAY_ADMIN_METRICS_TOKEN> or <GATEWAY_ADMIN_TOKEN>)",
            type="authentication_error",
            code="admin_credential_required",
        )


@dataclass(frozen=True, slots=True)
class LoginThrottle:
    """Wrong admin credentials per client (its address, or its device: see guesser()) over a
    sliding window, counted in the database by every gateway sharing it (a guesser spreading
    attempts over replicas is held all the same). The address is the connection's own: behind
    a load balancer, the balancer's, unless the operator names it in GATEWAY_TRUSTED_PROXIES
    (then the client its X-Forwarded-For names; no header is believed from anyone else,
    loopback included); the admin paths are reachable only from the operators' networks there
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
