"""Whose job's files a site reads: one reading at a time, tenants in turns of TURN_S each, round
robin, each tenant's jobs oldest first (issue 75: one intake thread read every job in the order
it came, and another key's 8-line job sat queued 150 s behind one 60 MiB job).

Each job's files are read on a thread of its own, which waits for its turn (`turn`) and, while
it reads, asks `pause` between two pieces of the reading (every 256 lines or examples, the
reading's `stop`): once its turn's time is spent and another tenant waits, it hands the turn on
and waits for its next. Only the turn holder reads, so reading takes one CPU as before; a paused
reading keeps what it read so far, and a tenant's later jobs wait for its first to be read, so a
tenant holds one reading's memory at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fedllm_contract.round_robin import RoundRobin
from fedllm_contract.training_data import Stopped

# A turn's time: long enough that handing on costs nothing next to it, short enough that a small
# job's reading waits for a few turns at most.
TURN_S = 0.1


class Turn:
    """One job's place in the turns; `stopped` says the job no longer wants its files read."""

    def __init__(self, tenant: str, stopped: Callable[[], bool]) -> None:
        self.tenant, self.stopped = tenant, stopped
        self.began = 0.0


class ReadingTurns:
    def __init__(self, turn_s: float = TURN_S) -> None:
        self._turn_s = turn_s
        self._changed = threading.Condition()
        self._waiting: RoundRobin[str, Turn] = RoundRobin()
        self._holder: Turn | None = None
        self._closed = False

    @contextmanager
    def turn(self, tenant: str, stopped: Callable[[], bool]) -> Iterator[Turn]:
        """Waits for the reading's first turn and holds it until the block ends; Stopped if the
        job is stopped (or the turns close) first."""
        turn = Turn(tenant, stopped)
        with self._changed:
            self._waiting.push(tenant, turn)
            self._wait(turn)
        try:
            yield turn
        finally:
            with self._changed:
                self._hand_on(turn)

    def pause(self, turn: Turn) -> bool:
        """The reading's `stop`: True once its job is stopped; hands the turn on (and waits for
        the next) once its time is spent while another tenant's reading waits."""
        if turn.stopped():
            return True
        if time.monotonic() - turn.began < self._turn_s:
            return False
        with self._changed:
            if self._waiting:
                self._waiting.requeue(turn.tenant, turn)
                self._hand_on(turn)
                self._wait(turn)
            turn.began = time.monotonic()
        return turn.stopped()

    def wake(self) -> None:
        """A job was stopped: its reading, if it waits for a turn, stops waiting."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """The site stops: no reading waits or takes a turn any more."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _wait(self, turn: Turn) -> None:
        """Under the lock, `turn` waiting: until it holds the turn, or Stopped."""
        self._hand_on(None)
        self._changed.wait_for(lambda: self._holder is turn or self._closed or turn.stopped())
        if self._holder is not turn:
            self._waiting.remove(turn.tenant, turn)
            raise Stopped("stopped while waiting for its turn to be read")
        turn.began = time.monotonic()

    def _hand_on(self, turn: Turn | None) -> None:
        """Under the lock: `turn` lets go (None: nobody did), and the next waiting takes it."""
        if turn is not None and self._holder is turn:
            self._holder = None
        if self._holder is None and self._waiting and not self._closed:
            _, self._holder = self._waiting.pop()
            self._changed.notify_all()
