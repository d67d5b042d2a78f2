"""How long an event loop is held: the CPU time it spends between two turns of a ticker task
(the longest stretch in which nothing else on the loop could run). Judged in the loop thread's
CPU time, not in wall-clock lag: on a loaded 2-core host a turn waits for a CPU as long as the
load makes it, whatever the code does, while the CPU time of one stretch is the code's own.

The code's own is its user time: the thread's system time also holds what the kernel does for a
host short of memory (reclaiming and compacting pages on a fault in the thread that faults), which
a CI run measured once at 158 ms in a stretch whose work measures 4 ms on a quiet host. The
stretch's system time is kept beside it, for the failure's message."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from anyio.from_thread import BlockingPortal


@dataclass
class Held:
    """The most CPU time (user) the loop spent between two turns of the ticker, and the
    system time of that stretch."""

    most_s: float = 0.0
    turns: int = 0
    system_s: float = 0.0


def _thread_times() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime


async def tick(held: Held) -> None:
    """Turns until cancelled, recording the longest stretch between two turns."""
    last_user, last_system = _thread_times()
    while True:
        await asyncio.sleep(0)
        user, system = _thread_times()
        if user - last_user > held.most_s:
            held.most_s, held.system_s = user - last_user, system - last_system
        held.turns += 1
        last_user, last_system = user, system


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
