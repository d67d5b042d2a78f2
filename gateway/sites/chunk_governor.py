"""The chunk budget under a busy event loop (GATEWAY_STREAM_CHUNKS_MIN_PER_S; 0, the default:
none, a fixed budget).

One gateway process is one event loop, and past about a core of work its answers' chunks queue
behind each other and behind new requests: on two H200s at ~270 req/s (issue 78, r92) a request
waited 0.2-0.45 s between the client and its dispatch, and the arm that streamed the most chunks
fell off the knee first. Of the loop's work, chunks are the one part that can shrink without
losing anything: an answer's tokens merge into fewer, fuller chunks (the client gets the same
tokens a little burstier), and the sites, told the longer interval, send fewer messages too. A
request's parsing, routing and record cannot.

So the loop checks itself every PERIOD_S: a sleep that wakes more than LAG_HIGH_S late means the
loop has more ready work than time, and the budget's share is cut (by CUT, to the floor); one
that wakes within LAG_LOW_S means room, and the share grows back (by GROW, to the whole budget).
Multiplicative both ways, so it leaves the floor in ~20 checks (~1 s) once the load goes. The
simulated gateway runs the same governor on its loop's backlog (fedsim/serving_path.py).

Measured (bench/results/serving_path/serving_path_governor_r92.md): one gateway saturated by
1,024 streams delivered 1.18-1.30x the tokens with it, at 0.5-0.7 of the CPU a token, first
tokens 2.2-3x sooner. In the twin of issue 78's federation at 1.1x it raised TTFT p50 in 11
arms of 12 (its clients count a first chunk only when it has text, and with random weights most
first tokens have none: the next chunk waits the longer interval), so it is off by default."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

PERIOD_S = 0.05
LAG_HIGH_S = 0.005
LAG_LOW_S = 0.001
CUT = 0.7
GROW = 1.1


@dataclass(slots=True)
class ChunkGovernor:
    """Contract: `share` stays within [floor, 1]; each `observe` of a check that came more than
    LAG_HIGH_S late multiplies it by CUT, of one within LAG_LOW_S by GROW, of one between leaves
    it; a floor of 1 never moves it."""

    floor: float
    share: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.floor <= 1.0:
            raise ValueError(f"the budget's floor is a share in (0, 1], got {self.floor}")

    @classmethod
    def of(cls, chunks_per_s: float, min_chunks_per_s: float) -> ChunkGovernor | None:
        """The governor of a budget and its floor (GATEWAY_STREAM_CHUNKS_PER_S, _MIN_PER_S):
        None where the budget is fixed (a floor of 0, or not below the budget) or unbounded."""
        if not 0 < min_chunks_per_s < chunks_per_s:
            return None
        return cls(min_chunks_per_s / chunks_per_s)

    def observe(self, lag_s: float) -> float:
        """The share after a check that woke `lag_s` late."""
        if lag_s > LAG_HIGH_S:
            self.share = max(self.floor, self.share * CUT)
        elif lag_s <= LAG_LOW_S:
            self.share = min(1.0, self.share * GROW)
        return self.share


class Shared(Protocol):
    """What the governor steers (grpc_generate_stream.ChunkPacer)."""

    share: float


async def govern(pacer: Shared, governor: ChunkGovernor, period_s: float = PERIOD_S) -> None:
    """Forever: every `period_s`, the pacer's share from how late the loop woke."""
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        await asyncio.sleep(period_s)
        pacer.share = governor.observe(loop.time() - began - period_s)
