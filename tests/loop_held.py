"""How long an event loop is held: the CPU time it spends between two turns of a ticker task
(the longest stretch in which nothing else on the loop could run). Judged in the loop thread's
CPU time, not in wall-clock lag: on a loaded 2-core host a turn waits for a CPU as long as the
load makes it, whatever the code does, while the CPU time of one stretch is the code's own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from anyio.from_thread import BlockingPortal


@dataclass
class Held:
    """The most CPU time the loop spent between two turns of the ticker."""

    most_s: float = 0.0
    turns: int = 0


async def tick(held: Held) -> None:
    """Turns until cancelled, recording the longest stretch between two turns."""
    last = time.thread_time()
    while True:
        await asyncio.sleep(0)
        now = time.thread_time()
        held.most_s, held.turns = max(held.most_s, now - last), held.turns + 1
        last = now


@asynccontextmanager
async def ticking() -> AsyncIterator[Held]:
    """A ticker on the running loop for the block."""
    held = Held()
    ticker = asyncio.create_task(tick(held))
    await asyncio.sleep(0)
    try:
        yield held
    finally:
        ticker.cancel()


@contextmanager
def ticking_in(portal: BlockingPortal) -> Iterator[Held]:
    """A ticker on the loop behind `portal` (a litestar TestClient's) for the block."""
    held = Held()
    future = portal.start_task_soon(tick, held)
    try:
        yield held
    finally:
        future.cancel()
