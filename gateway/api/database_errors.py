"""A database that cannot be reached is a passing outage, not a bug: 503 with Retry-After.

The gateway records every request before it goes to a site (gateway/stores/request_log.py),
so while PostgreSQL is restarting, failing over or refusing connections a request cannot be
accepted. The client is told to retry (OpenAI shape, `code: database_unavailable`) instead of
getting a 500. The connection pool's pre-ping replaces dead connections once the database is
back (tests/fault/test_faults.py drops them on purpose).
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.types import ExceptionHandlersMap
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from gateway.api.openai_errors import ErrorEnvelope, OpenAIError, error_response

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


def _database_unavailable(_: Request[Any, Any, Any], exc: Exception) -> Response[ErrorEnvelope]:
    # One line, not a traceback: the outage is expected to be reported many times a second.
    log.warning("database unavailable, answering 503: %s", str(exc).splitlines()[0][:300])
    return error_response(
        OpenAIError(
            503,
            "the gateway's database is unavailable; retry shortly",
            type="server_error",
            code="database_unavailable",
            retry_after_s=RETRY_AFTER_S,
        )
    )


# Connection lost or refused (OperationalError), the driver's link broken (InterfaceError), or
# no pooled connection free in time (TimeoutError).
DATABASE_EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    OperationalError: _database_unavailable,
    InterfaceError: _database_unavailable,
    PoolTimeoutError: _database_unavailable,
}
