"""A bound on clients that stop reading: the connection is cut once its answer has waited
GATEWAY_SEND_STALL_TIMEOUT_S for the client to take any of it.

Without it, a streaming client that stops reading (a receive window left shut) blocks the send
with no deadline: its request keeps its place in the gateway's in-flight bound, its key's
concurrency slot and its site's batch for as long as the connection lives (the load balancer
keeps idle connections 900 s; a direct client, forever). The transport tells when that
happens: it pauses writing once its buffer (over what the kernel holds) passes its high-water
mark and resumes when the client has taken most of it. A pause that lasts the bound aborts the
connection; the server then sees the client gone, and the request ends as any abandoned stream
does: cancelled at its site, recorded as cancelled, its slots given back. A client that reads,
however slowly, resumes the writes and is never cut; one that trickles too little to drain the
buffer is cut, its stream being no more use to it than to the others it would hold up.

StallBound is mixed into uvicorn's HTTP/1.1 protocol (httptools': C, about 0.3 ms less CPU per
request than h11's pure-Python parser), with the deadlines on what clients send, by
gateway/api/http_protocol.py's bounded_protocol(), the class uvicorn takes as its `http` option.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


class StallBound:
    """Mixed into a uvicorn HTTP protocol class (before it)."""

    # Set per server by gateway/api/http_protocol.py's bounded_protocol().
    stall_timeout_s: float = 30.0
    _stall: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: Any
    client: tuple[str, int] | None

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._stall is None:
            self._stall = self.loop.call_later(self.stall_timeout_s, self._abort_stalled)

    def resume_writing(self) -> None:
        self._cancel_stall()
        super().resume_writing()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_stall()
        super().connection_lost(exc)  # type: ignore[misc]

    def _cancel_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _abort_stalled(self) -> None:
        self._stall = None
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning(
            "%s took none of its answer for %gs (GATEWAY_SEND_STALL_TIMEOUT_S): connection "
            "cut, its request cancelled",
            client,
            self.stall_timeout_s,
        )
        self.transport.abort()
