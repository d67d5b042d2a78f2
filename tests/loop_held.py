"""How long an event loop is held: the CPU time it spends between two turns of a ticker task
(the longest stretch in which nothing else on the loop could run). Judged in the loop thread's
CPU time, not in wall-clock lag: on a loaded 2-core host a turn waits for a CPU as long as the
load makes it, whatever the code does, while the CPU time of one stretch is the code's own.

The code's own is its user time: the thread's system time also holds what the kernel does for a
host short of memory (reclaiming and compacting pages on a fault in the thread that faults), which
a CI run measured once at 158 ms in a stretch whose work measures 4 ms on a quiet host. The
stretch's system time is kept beside it, for the failure's message.

A bound in CPU seconds is still the speed of the CPU it was set on: a slow 2-core Intel Xeon ran
the batch-scale test's stretch in 29 ms against a bound of 25 set where it measured 20. So bounds
are scaled by `slowness()`: a fixed piece of plain-Python work (the kind the loop's stretches are:
dicts, JSON, sorting) timed here against the same on the machine the bounds were set on."""

from __future__ import annotations

import asyncio
import functools
import json
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


# `_reference_work`'s least user time of five on the machine the loop bounds were measured on
# (a 2-core AMD EPYC, 2026-11-29: 0.18-0.29 s, a run's least 0.17-0.18).
_REFERENCE_WORK_S = 0.18


def _reference_work() -> int:
    rows = [
        {"index": i, "custom_id": f"req-{i}", "body": {"messages": [{"content": "x" * (i % 50)}]}}
        for i in range(20_000)
    ]
    back = [json.loads(json.dumps(row)) for row in rows]
    back.sort(key=lambda row: str(row["custom_id"]))
    return len(back)


@functools.cache
def slowness() -> float:
    """How many times slower than the reference machine this one runs plain Python (>= 1: a
    faster machine keeps the bound as set). The least of five timings, in the thread's user
    time: a run can only be slowed by what shares the core, never sped up."""
    taken = []
    for _ in range(5):
        before = _thread_times()[0]
        _reference_work()
        taken.append(_thread_times()[0] - before)
    return max(1.0, min(taken) / _REFERENCE_WORK_S)


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
