"""What can go wrong with a request, as plain exceptions of the core.

The services raise these; only the HTTP layer (gateway/api/openai_errors.py) turns them into a
status code and OpenAI's error envelope. Each carries what a client is told: the message, the
parameter at fault, a machine-readable code and, for a passing condition, when to try again. The
class says what kind of failure it is, hence whether the same request may succeed later (the
batch runner tries those again) and OpenAI's error `type` (stored with a failed batch item).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar


class GatewayError(Exception):
    # OpenAI's error type for this kind of failure: the client's request, or the server's side.
    error_type: ClassVar[str] = "invalid_request_error"
    # Whether the same request may succeed when tried again later.
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return self.error_type

    def fields(self) -> dict[str, object]:
        """OpenAI's error object: message, type, and param and code when set."""
        found = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {key: value for key, value in found.items() if value is not None}


class InvalidRequest(GatewayError):
    """The request is malformed or asks for something this gateway does not do."""


class NotFound(GatewayError):
    """The request names a model, batch, key or site that does not exist."""


class Unauthenticated(GatewayError):
    """No live API key: missing, unknown or revoked."""


class Conflict(GatewayError):
    """The request collides with the state of what it names (a key's request still running, a
    batch already settled)."""


class Mismatch(GatewayError):
    """A replay that is not the same request (an Idempotency-Key reused for another body)."""


class RateLimited(GatewayError):
    """A key's limit (requests, tokens, or requests in flight) refuses the request now."""

    retryable = True

    def __init__(
        self,
        message: str,
        *,
        limit: str,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message, code=code, retry_after_s=retry_after_s)
        # Which limit refused it ("requests" or "tokens"): OpenAI's error type for rate limits.
        self.limit = limit

    @property
    def type(self) -> str:
        return self.limit


class ServerSideError(GatewayError):
    """The gateway or its sites could not serve a valid request."""

    error_type = "server_error"
    retryable = True


class Overloaded(ServerSideError):
    """The gateway holds its limit of requests in flight."""


class Unavailable(ServerSideError):
    """No site can take the request now (none healthy, all full, or the one it was on left)."""


class UpstreamFailed(ServerSideError):
    """The site serving the request failed it and no other site could continue it."""


class TimedOut(ServerSideError):
    """The request did not finish within its deadline."""


class InternalFailure(ServerSideError):
    """Something the gateway did not expect (a database that went away mid-request)."""


def invalid_request(
    message: str, param: str | None = None, code: str | None = None
) -> GatewayError:
    return InvalidRequest(message, param=param, code=code)


# param -> (does the gateway serve this value, why it serves no other): a feature the gateway
# lacks, refused by name only when a request asks for it.
Unserved = Mapping[str, tuple[Callable[[Any], bool], str]]


def refuse_unserved(request: object, unserved: Unserved) -> None:
    """400 naming the first parameter of `request` that asks for what the gateway lacks."""
    for param, (served, reason) in unserved.items():
        value = getattr(request, param)
        if not served(value):
            raise invalid_request(
                f"'{param}' is not supported by this gateway: {reason} (got {value!r})",
                param=param,
            )


def context_exceeded(message: str, param: str) -> GatewayError:
    """More tokens than the model's context holds: OpenAI's code, whatever the endpoint."""
    return InvalidRequest(message, param=param, code="context_length_exceeded")


def model_not_found(model: str) -> GatewayError:
    return NotFound(f"The model '{model}' does not exist", param="model", code="model_not_found")


def service_unavailable(message: str, retry_after_s: int = 1) -> GatewayError:
    return Unavailable(message, code="service_unavailable", retry_after_s=retry_after_s)


def upstream_failed(message: str) -> GatewayError:
    return UpstreamFailed(message, code="site_failed")


def request_timed_out(message: str) -> GatewayError:
    return TimedOut(message, code="request_timeout")


def gateway_overloaded(message: str, retry_after_s: int = 1) -> GatewayError:
    return Overloaded(message, code="gateway_overloaded", retry_after_s=retry_after_s)
