"""Errors in the OpenAI shape {"error": {"message", "type", "param", "code"}} and status."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import ExceptionHandlersMap

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


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model '{model}' does not exist", param="model", code="model_not_found"
    )


def service_unavailable(message: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(
        503, message, type="server_error", code="service_unavailable", retry_after_s=retry_after_s
    )


def upstream_failed(message: str) -> OpenAIError:
    return OpenAIError(502, message, type="server_error", code="site_failed")


def request_timed_out(message: str) -> OpenAIError:
    return OpenAIError(504, message, type="server_error", code="request_timeout")


def gateway_overloaded(message: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(
        429, message, type="server_error", code="gateway_overloaded", retry_after_s=retry_after_s
    )


def error_response(error: OpenAIError) -> Response[ErrorEnvelope]:
    headers = {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return Response(
        error.envelope(), status_code=error.status, headers=headers, media_type=MediaType.JSON
    )


def _openai_error(_: Request[Any, Any, Any], exc: OpenAIError) -> Response[ErrorEnvelope]:
    return error_response(exc)


def _http_error(_: Request[Any, Any, Any], exc: HTTPException) -> Response[ErrorEnvelope]:
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
    HTTPException: _http_error,
    Exception: _unexpected,
}
