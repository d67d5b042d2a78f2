"""The time an answer without a client's length limit may take (GATEWAY_OPEN_ANSWER_TIMEOUT_S).

Chat and the Responses API let a client leave `max_tokens` out: the answer then runs to its end
or to the model's context. A greedy answer that loops never ends on its own, and on a slow site
(a CPU decodes a few tokens a second) the context is thousands of seconds away: the request
would hit GATEWAY_REQUEST_TIMEOUT_S and the client get a 504 for tokens it was billed and never
shown. So such an answer also ends at its time, from its dispatch, as one cut at its length
limit ends: finish_reason "length", with what was generated, billed as generated.

Its time runs out only once it has begun (a request still queued at its site waits as any
other, up to the request's deadline); the reader stops waiting for the site then, which closes
the site's stream and so cancels the request there.

One timer per answer, not one per chunk: most chat clients send no `max_tokens`, and an
`asyncio.timeout` around each read cost 4.3 us of CPU a chunk against 1.3 us for the read
itself (an ad hoc measurement under uvloop on the 2-core dev machine; this way, 0.8 us). When
the timer fires while the reader waits for the site, it cancels that wait; otherwise the reader
sees `ran_out` before its next one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from gateway.sites.interface import SiteChunk


@dataclass(slots=True)
class AnswerClock:
    """One answer's time: `deadline` in time.monotonic()'s seconds."""

    deadline: float
    begun: bool = False
    ran_out: bool = False
    # The task waiting for the site's next chunk, while it waits; the timer cancels that wait.
    _waiting: asyncio.Task[object] | None = None
    _cancelled_wait: bool = False
    _timer: asyncio.TimerHandle | None = None

    async def read(self, chunks: AsyncIterator[SiteChunk]) -> AsyncGenerator[SiteChunk, None]:
        """The site's chunks, until they end or, once the answer has begun, its time does
        (`ran_out` then says so)."""
        try:
            if self.begun:  # a later site's stream of the same answer: the time goes on
                self._start()
            while not self.ran_out:
                task = self._waiting = asyncio.current_task()
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not self._cancelled_wait or task is None or task.uncancel() > 0:
                        raise  # not (only) this clock's: the caller went away
                    return
                finally:
                    self._waiting = None
                if not self.begun and chunk.token_ids:
                    self.begun = True
                    self._start()
                yield chunk
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _start(self) -> None:
        delay = max(self.deadline - time.monotonic(), 0.0)
        self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self.ran_out = True
        if self._waiting is not None:
            self._cancelled_wait = True
            self._waiting.cancel()
