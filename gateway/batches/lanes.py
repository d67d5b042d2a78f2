"""A lane: the queued items of one batch assigned to one site, read a page at a time in the
order the batch plan ranked them (gateway/batches/plan.py), by the workers that run them."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from gateway.batches.records import LaneKey, QueuedItem
from gateway.batches.store import BatchStore


@dataclass(slots=True)
class LaneCursor:
    store: BatchStore
    batch_id: str
    site_id: int | None
    page: int
    after: LaneKey | None = None
    exhausted: bool = False
    buffer: deque[QueuedItem] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def next(self) -> QueuedItem | None:
        async with self.lock:
            if not self.buffer and not self.exhausted:
                rows = await self.store.lane(self.batch_id, self.site_id, self.after, self.page)
                self.exhausted = len(rows) < self.page
                if rows:
                    self.after = rows[-1].lane_key()
                self.buffer.extend(rows)
            return self.buffer.popleft() if self.buffer else None
