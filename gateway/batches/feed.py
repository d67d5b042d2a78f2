"""Steady feeding: each site gets just enough batch work to fill its idle capacity, all batches
together, and a batch near its deadline goes first.

Items stay queued in the database; a lane reads a page of them in plan order and a worker starts
one only once the site's feed grants it a place. The number of places follows the site's own
reports: its batch slots (max_num_seqs) less the interactive work it holds (running and queued,
as its last load report or this gateway's own count says, the larger), at least one (a batch
always moves) and at most GATEWAY_BATCH_SITE_CONCURRENCY. So a million-item batch never floods
a site, a site busy with chat gets one batch item at a time, and an idle site is filled.
Background work already there (flex requests, other gateways' batch items) does not shrink the
room: the site serves it behind interactive work and preempts it for chat, so it is not load
that batch items must wait out (a site that does not report classes counts all its work).

Waiting places are granted in order of urgency (`urgency`): batches whose completion window is
nearly spent first, then by deadline, then first come.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
from collections.abc import AsyncIterator, Callable
from datetime import datetime

from gateway.sites.interface import LoadView

# A waiter looks again this often: the site's reports change its room without a release.
RECHECK_S = 0.5

Urgency = tuple[int, float]


def batch_room(slots: int | None, busy: int, batch_in_flight: int, cap: int) -> int:
    """Contract: the batch items the site should hold now: its slots less the other work it
    holds (busy less this feed's own items), within [1, cap]; cap when the site does not say
    how many slots it has."""
    if slots is None:
        return cap
    others = max(busy - batch_in_flight, 0)
    return max(1, min(cap, slots - others))


def interactive_busy(report: LoadView | None, site_in_flight: int, batch_in_flight: int) -> int:
    """Contract: the interactive requests a site holds: its last report's count, or this
    gateway's own requests there less its batch items (`site_in_flight` counts both), the
    larger; 0 for a site that has not reported and holds none of ours."""
    reported = report.interactive_requests if report is not None else 0
    return max(reported, site_in_flight - batch_in_flight, 0)


def urgency(
    expires_at: datetime | None,
    created_at: datetime | None,
    now: datetime,
    margin: float,
    eta_s: float | None = None,
) -> Urgency:
    """Contract: (0, deadline) for a batch whose window has less than `margin` of it left, or
    less time left than its estimated remaining run time; (1, deadline) otherwise; (1, inf)
    without a deadline. Smaller goes first."""
    if expires_at is None:
        return 1, math.inf
    left_s = (expires_at - now).total_seconds()
    window_s = (expires_at - created_at).total_seconds() if created_at is not None else None
    near = window_s is not None and window_s > 0 and left_s < margin * window_s
    late = eta_s is not None and left_s < eta_s
    return (0 if near or late else 1), expires_at.timestamp()


class SiteFeed:
    """The places for batch items at one site. `room` says how many the site should hold given
    how many this feed holds now."""

    def __init__(self, room: Callable[[int], int]) -> None:
        self._room = room
        self.in_flight = 0
        self._waiters: list[tuple[Urgency, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @contextlib.asynccontextmanager
    async def place(self, priority: Urgency) -> AsyncIterator[None]:
        await self._take(priority)
        try:
            yield
        finally:
            self.in_flight -= 1
            self._grant()

    async def _take(self, priority: Urgency) -> None:
        if not self._waiters and self.in_flight < self._room(self.in_flight):
            self.in_flight += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._order), granted))
        try:
            while not granted.done():
                self._grant()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(granted), RECHECK_S)
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.in_flight -= 1  # granted as it was cancelled: hand the place on
                self._grant()
            else:
                granted.cancel()
            raise

    def _grant(self) -> None:
        while self._waiters and self.in_flight < self._room(self.in_flight):
            _, _, granted = heapq.heappop(self._waiters)
            if granted.done():  # its waiter was cancelled
                continue
            self.in_flight += 1
            granted.set_result(None)
