"""One HTTP/1.1 connection that posts streaming completions and reads their SSE answers, built
to cost its client process as little as a client can: an asyncio Protocol (no coroutine switch
per chunk), chunked transfer decoding on bytes, and each event looked at by byte searches, its
JSON parsed only for the usage chunk and errors (once a request).

A request's outcome (`Answer`): its HTTP status, when its first text came and when it ended, the
events that carried text, the completion tokens its usage chunk gave, its finish_reason, and
whether `[DONE]` came. An answer that ended otherwise is a cut-off (the connection closed, or an
error event mid-stream); a status other than 200 is a refusal, with the start of its body.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import cast

_HEAD_END = b"\r\n\r\n"
_DONE = b"data: [DONE]"
_SITE = b"\r\nx-fedllm-site:"  # the gateway's SITE_HEADER, in the lower-cased head


@dataclass(slots=True)
class Answer:
    status: int = 0
    first_s: float | None = None  # monotonic time of its first text
    end_s: float | None = None
    events: int = 0  # events with text
    tokens: int = 0  # completion_tokens of its usage chunk
    finish_reason: str | None = None
    done: bool = False  # `data: [DONE]` came
    error: str | None = None
    # Events with text at the start of each measurement window it was open at: {window: events}.
    marks: dict[int, int] = field(default_factory=dict)
    # The site the gateway first sent it to (its X-Fedllm-Site header; None: no such header),
    # so a bench can compare placements request by request.
    site: str | None = None

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.done and self.finish_reason is not None


class StreamConnection(asyncio.Protocol):
    """A keep-alive connection; one request at a time (`post`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._answer: Answer | None = None
        self._finished: asyncio.Future[Answer] | None = None
        self._buffer = bytearray()
        self._events = bytearray()
        self._head = True
        self._chunked = False
        self._length = 0  # the body's bytes still due (not chunked)

    @classmethod
    async def open(cls, host: str, port: int) -> StreamConnection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(cls, host, port)
        return connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is no asyncio.Transport subclass, but has its methods).
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is not None:
            self._answer.error = self._answer.error or f"connection closed ({exc})"
            self._end()

    async def post(self, request: bytes, answer: Answer) -> Answer:
        """Sends the whole request (head and body, bytes made by `request_bytes`) and waits for
        the answer's end; `answer` fills as it comes (the caller may read it meanwhile)."""
        if self.closed or self.transport is None:
            raise ConnectionError("the connection is closed")
        self._answer, self._head, self._chunked, self._length = answer, True, False, 0
        self._buffer.clear()
        self._events.clear()
        self._finished = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self._finished

    def data_received(self, data: bytes) -> None:
        if self._answer is None:
            return
        self._buffer += data
        if self._head and not self._read_head():
            return
        if self._chunked:
            self._read_chunks()
        else:
            self._read_plain()

    def _read_head(self) -> bool:
        end = self._buffer.find(_HEAD_END)
        if end < 0:
            return False
        head = bytes(self._buffer[:end]).lower()
        del self._buffer[: end + 4]
        assert self._answer is not None
        self._answer.status = int(head[9:12])
        self._answer.site = _header(head, _SITE)
        self._chunked = b"transfer-encoding: chunked" in head
        if not self._chunked:
            at = head.find(b"content-length:")
            self._length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
        self._head = False
        return True

    def _read_plain(self) -> None:
        """An answer that is not a stream: an error's JSON body."""
        if len(self._buffer) < self._length:
            return
        assert self._answer is not None
        body = bytes(self._buffer[: self._length]).decode(errors="replace")
        self._answer.error = body[:300] or f"HTTP {self._answer.status}"
        self._end()

    def _read_chunks(self) -> None:
        buffer = self._buffer
        at = 0
        while True:
            line_end = buffer.find(b"\r\n", at)
            if line_end < 0:
                break
            size = int(bytes(buffer[at:line_end]).split(b";", 1)[0], 16)
            if len(buffer) < line_end + 2 + size + 2:
                break
            if size == 0:
                del buffer[:]
                self._read_events()
                self._body_end()
                return
            self._events += buffer[line_end + 2 : line_end + 2 + size]
            at = line_end + 2 + size + 2
        del buffer[:at]
        self._read_events()

    def _read_events(self) -> None:
        *complete, rest = bytes(self._events).split(b"\n\n")
        self._events = bytearray(rest)
        for event in complete:
            self._event(event)

    def _event(self, event: bytes) -> None:
        answer = self._answer
        assert answer is not None
        if event == _DONE:
            answer.done = True
            return
        if not event.startswith(b"data: "):
            return  # an SSE comment or keep-alive
        if b'"choices":[{' in event:
            if b'"text":""' not in event and b'"content":""' not in event:
                answer.events += 1
                if answer.first_s is None:
                    answer.first_s = time.monotonic()
            at = event.find(b'"finish_reason":"')
            if at >= 0:
                start = at + 17
                answer.finish_reason = event[start : event.index(b'"', start)].decode()
        elif b'"usage":{' in event:
            answer.tokens = int(json.loads(event[6:])["usage"]["completion_tokens"])
        elif b'{"error"' in event[:16]:
            answer.error = event[6:306].decode(errors="replace")

    def _body_end(self) -> None:
        assert self._answer is not None
        if self._answer.status != 200 and self._answer.error is None:
            self._answer.error = bytes(self._events[:300]).decode(errors="replace")
        self._end()

    def _end(self) -> None:
        answer, finished = self._answer, self._finished
        self._answer = self._finished = None
        self.idle_since = time.monotonic()
        if answer is None:
            return
        answer.end_s = time.monotonic()
        if finished is not None and not finished.done():
            finished.set_result(answer)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _header(head: bytes, name: bytes) -> str | None:
    """A header's value in a lower-cased response head (`name`: CRLF, name and colon)."""
    at = head.find(name)
    if at < 0:
        return None
    return head[at + len(name) :].split(b"\r\n", 1)[0].strip().decode(errors="replace")


def request_bytes(port: int, body: dict[str, object]) -> bytes:
    """A POST of `body` to /v1/completions, head and body in one write."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload
