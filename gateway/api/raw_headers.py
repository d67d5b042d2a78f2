"""A request header read from the ASGI scope's raw list, for the per-request path.

litestar's `connection.headers` builds a Headers mapping of every header on first use; the
completion endpoints read two headers a request (Authorization, Idempotency-Key), and building
the mapping for them cost about 1 % of the gateway's core at a thousand streams.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def raw_header(scope: Any, name: bytes) -> str | None:
    """The first value of header `name` (lowercase: ASGI servers give names lowercased), or
    None. Latin-1, as HTTP/1.1 carries header bytes and litestar decodes them."""
    headers: Iterable[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
