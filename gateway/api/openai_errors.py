"""Errors in the OpenAI shape {"error": {"message", "type", "param", "code"}} and their HTTP
status: the core's domain errors (gateway/errors.py) mapped here, and the HTTP layer's own."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.types import ExceptionHandlersMap

from gateway.errors import (
    Conflict,
    GatewayError,
    InternalFailure,
    InvalidRequest,
    Mismatch,
    NotFound,
    Overloaded,
    RateLimited,
    TimedOut,
    Unauthenticated,
    Unavailable,
    UpstreamFailed,
)

log = logging.getLogger(__name__)


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)
        self.retry_after_s = retry_after_s

    def envelope(self) -> ErrorEnvelope:
        return ErrorEnvelope(self.body)


# The HTTP status of each kind of domain error.
HTTP_STATUS: dict[type[GatewayError], int] = {
    InvalidRequest: 400,
    Unauthenticated: 401,
    NotFound: 404,
    Conflict: 409,
    Mismatch: 422,
    RateLimited: 429,
    Overloaded: 429,
    InternalFailure: 500,
    UpstreamFailed: 502,
    Unavailable: 503,
    TimedOut: 504,
}


def http_status(error: GatewayError) -> int:
    return next(
        (status for kind, status in HTTP_STATUS.items() if isinstance(error, kind)),
        400 if not error.retryable else 500,
    )


def as_openai(error: GatewayError) -> OpenAIError:
    """The domain error as the client sees it."""
    return OpenAIError(
        http_status(error),
        error.message,
        type=error.type,
        param=error.param,
        code=error.code,
        retry_after_s=error.retry_after_s,
    )


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """The HTTP layer's own 400 (a body it cannot decode)."""
    return OpenAIError(400, message, param=param, code=code)


def to_openai(error: BaseException) -> OpenAIError:
    """An OpenAIError or a domain error as the client sees it."""
    if isinstance(error, GatewayError):
        return as_openai(error)
    if isinstance(error, OpenAIError):
        return error
    raise TypeError(f"not a client-facing error: {error!r}")


def error_envelope(error: OpenAIError | GatewayError) -> ErrorEnvelope:
    """What a stream sends when it fails after its status went out."""
    return to_openai(error).envelope()


def error_response(error: OpenAIError) -> Response[ErrorEnvelope]:
    headers = {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return Response(
        error.envelope(), status_code=error.status, headers=headers, media_type=MediaType.JSON
    )


def _openai_error(_: Request[Any, Any, Any], exc: OpenAIError) -> Response[ErrorEnvelope]:
    return error_response(exc)


def _domain_error(_: Request[Any, Any, Any], exc: GatewayError) -> Response[ErrorEnvelope]:
    return error_response(as_openai(exc))


def _no_route(request: Request[Any, Any, Any]) -> OpenAIError:
    """A path no route matches: under /v1, OpenAI's "Invalid URL" naming the path and what this
    gateway implements of the API instead (the routes registered, whichever controller added
    them: this answers only where no route matched, so it never shadows one)."""
    method, path = request.method, request.url.path
    if path != "/v1" and not path.startswith("/v1/"):
        return OpenAIError(404, f"Invalid URL ({method} {path}): no such route on this gateway")
    served = sorted(
        {
            route.path.rstrip("/")
            for route in request.app.routes
            if route.path.startswith("/v1/") and "{" not in route.path
        }
    )
    return OpenAIError(
        404,
        f"Invalid URL ({method} {path}): this gateway does not implement {path} of the OpenAI "
        f"API; it implements {', '.join(served)}",
        code="unknown_url",
    )


def _http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[ErrorEnvelope]:
    if isinstance(exc, NotFoundException) and "route_handler" not in request.scope:
        return error_response(_no_route(request))  # raised by routing, not by a handler
    status = exc.status_code
    kind = "invalid_request_error" if status < 500 else "server_error"
    message = exc.detail
    if isinstance(exc, ValidationException) and exc.extra:
        message = f"{exc.detail}: {exc.extra}"
    # A body past GATEWAY_MAX_BODY_BYTES: the same code as the batch API's own 413.
    code = "request_too_large" if status == 413 else None
    return error_response(OpenAIError(status, message, type=kind, code=code))


def _unexpected(_: Request[Any, Any, Any], exc: Exception) -> Response[ErrorEnvelope]:
    log.exception("unhandled error", exc_info=exc)
    return error_response(OpenAIError(500, "internal error", type="server_error"))


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    OpenAIError: _openai_error,
    GatewayError: _domain_error,
    HTTPException: _http_error,
    Exception: _unexpected,
}
