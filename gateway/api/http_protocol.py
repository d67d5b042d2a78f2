"""The gateway's HTTP/1.1 protocol: uvicorn's (httptools) with bounds on what clients send.

uvicorn closes a connection only when it has been idle for `timeout_keep_alive` after an answer
and no byte has come since; it never closes a new connection that sends nothing, one that sends
its headers a line at a time, or one whose body never comes (issue 32: 2,000 such connections
held open for 75 s+, and four stalled uploads held every upload slot). Here, per connection:

- idle: a connection with no request under way, a new one included, is closed after
  GATEWAY_KEEP_ALIVE_TIMEOUT_S of silence (uvicorn's own timer, also armed at the start);
- headers: a request's headers must be complete GATEWAY_HEADER_TIMEOUT_S after the connection
  opened or its previous answer ended, whatever trickles in meanwhile; and its request line and
  headers may take at most GATEWAY_MAX_HEADER_BYTES (httptools has no bound of its own: an
  80 MiB header was buffered whole and answered, issue 48). Past it the client gets 431 and the
  rest is never handed to the parser;
- body: a request body gets GATEWAY_BODY_TIMEOUT_S plus one second per
  GATEWAY_BODY_MIN_BYTES_PER_S bytes it has sent (Apache's mod_reqtimeout `body=N,MinRate=R`);
  while the gateway itself is not reading (its buffer is full, or it has not yet asked an
  `Expect: 100-continue` client for the body), the clock stands still.

Past a deadline with a request begun, the client gets a 408 in the OpenAI error shape and the
connection closes (after a 431 it lingers a moment, reading and dropping what the client still
sends, so that closing with unread bytes does not reset the connection before the client has
read the answer); the request's handler sees its client gone and gives back what it held
(an upload slot). A client that sends nothing is closed without a word. The bound on clients
that stop reading answers is gateway/api/slow_readers.py; bounded_protocol() combines both.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.api.slow_readers import StallBound
from gateway.settings import LimitsSettings

log = logging.getLogger(__name__)


# After a 431: how long the connection stays open, and how much more of the client's sending it
# reads (and drops) meanwhile, before closing.
LINGER_S = 1.0
LINGER_MAX_BYTES = 1 << 20


def _error_response(status: str, code: str, message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None}
    body = json.dumps({"error": {**error, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _timeout_response(message: str) -> bytes:
    return _error_response("408 Request Timeout", "request_timeout", message)


class ConnectionDeadlines:
    """Mixed into uvicorn's httptools protocol (before it); bounds set by bounded_protocol()."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    body_min_bytes_per_s: float = 16384.0
    max_header_bytes: int = 65536
    _header_timer: asyncio.TimerHandle | None = None
    # Bytes received since the previous request ended (or the connection opened) while the next
    # one's head is incomplete; whether it is (no request under way, or its headers still come).
    _head_bytes: int = 0
    _in_head: bool = True
    # A 431 was sent: what comes now is dropped until the connection closes.
    _refused_bytes: int | None = None
    _linger: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    # The body clock: when it started (moved on by time the gateway was not reading), when it
    # was last looked at, and the bytes received since it started.
    _body_since: float = 0.0
    _body_checked: float = 0.0
    _body_bytes: int = 0
    # A request's first bytes came and its headers are not complete yet.
    _request_begun: bool = False
    loop: asyncio.AbstractEventLoop
    transport: Any
    cycle: Any
    flow: Any
    pipeline: Any
    headers: list[tuple[bytes, bytes]]
    client: tuple[str, int] | None
    timeout_keep_alive: float
    timeout_keep_alive_task: asyncio.TimerHandle | None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()
        # uvicorn arms its idle timer after an answer only: a new connection is idle too.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive,
            self.timeout_keep_alive_handler,  # type: ignore[attr-defined]
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused_bytes is not None:
            self._drop(len(data))
            return
        room = self.max_header_bytes - self._head_bytes
        if not self._in_head or len(data) <= room:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)  # type: ignore[misc]
            return
        # Only what fits the bound is parsed: if the head does not end within it, it is refused.
        self._head_bytes = self.max_header_bytes
        if room > 0:
            super().data_received(data[:room])  # type: ignore[misc]
        if self.transport.is_closing():  # refused by the parser (400)
            return
        if self._in_head:
            self._refuse_head()
            self._drop(len(data) - room)
        else:
            self.data_received(data[room:])  # the body, maybe the next request's head

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._request_begun = True

    def on_headers_complete(self) -> None:
        self._request_begun = self._in_head = False
        self._cancel_header_timer()
        super().on_headers_complete()  # type: ignore[misc]
        if self._has_body():
            self._body_since = self._body_checked = self.loop.time()
            self._body_bytes = 0
            self._arm_body_timer(self.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()  # type: ignore[misc]

    def on_response_complete(self) -> None:
        waiting = not self.pipeline  # else the next request's headers are in already
        super().on_response_complete()  # type: ignore[misc]
        self._cancel_body_timer()
        if waiting and not self.transport.is_closing():
            self._arm_header_timer()

    def _has_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return True
        return False

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _arm_body_timer(self, delay_s: float) -> None:
        self._cancel_body_timer()
        self._body_timer = self.loop.call_later(delay_s, self._check_body)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._request_begun:
            late_s = self.header_timeout_s
            log.info("%s: request headers incomplete after %gs: 408", self._who(), late_s)
            self.transport.write(
                _timeout_response(
                    "the request's headers did not arrive in time (GATEWAY_HEADER_TIMEOUT_S="
                    f"{self.header_timeout_s:g}s)"
                )
            )
        self.transport.close()

    def _refuse_head(self) -> None:
        """431, then the connection lingers (dropping what comes) and closes."""
        log.info("%s: request head over %d bytes: 431", self._who(), self.max_header_bytes)
        self._cancel_header_timer()
        self._refused_bytes = 0
        self.transport.write(
            _error_response(
                "431 Request Header Fields Too Large",
                "headers_too_large",
                "the request line and headers are longer than GATEWAY_MAX_HEADER_BYTES="
                f"{self.max_header_bytes} bytes",
            )
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    def _drop(self, size: int) -> None:
        """Bytes a refused client still sends: read and dropped, up to LINGER_MAX_BYTES."""
        assert self._refused_bytes is not None
        self._refused_bytes += size
        if self._refused_bytes > LINGER_MAX_BYTES:
            self.transport.close()

    def _check_body(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_started:
            return
        now = self.loop.time()
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            # The gateway is not reading this body now: the client cannot be late.
            self._body_since += now - self._body_checked
        self._body_checked = now
        deadline = (
            self._body_since + self.body_timeout_s + self._body_bytes / self.body_min_bytes_per_s
        )
        if now < deadline:
            self._arm_body_timer(deadline - now)
            return
        sent, taken_s = self._body_bytes, now - self._body_since
        log.info("%s: request body too slow (%d bytes in %.0fs): 408", self._who(), sent, taken_s)
        # The handler's own answer (it will see its client gone) is dropped: this is the answer.
        cycle.response_started = cycle.response_complete = cycle.disconnected = True
        cycle.message_event.set()
        self.transport.write(
            _timeout_response(
                "the request body arrived too slowly (GATEWAY_BODY_TIMEOUT_S="
                f"{self.body_timeout_s:g}s, then GATEWAY_BODY_MIN_BYTES_PER_S="
                f"{self.body_min_bytes_per_s:g})"
            )
        )
        self.transport.close()

    def _who(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


def bounded_protocol(limits: LimitsSettings) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn (`http=`): httptools' HTTP/1.1 with the deadlines
    above and the bound on clients that stop reading (gateway/api/slow_readers.py)."""
    return type(
        "GatewayHttpProtocol",
        (StallBound, ConnectionDeadlines, HttpToolsProtocol),
        {
            "stall_timeout_s": limits.send_stall_timeout_s,
            "header_timeout_s": limits.header_timeout_s,
            "body_timeout_s": limits.body_timeout_s,
            "body_min_bytes_per_s": float(limits.body_min_bytes_per_s),
            "max_header_bytes": limits.max_header_bytes,
        },
    )
