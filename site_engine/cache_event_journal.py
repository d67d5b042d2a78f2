"""The site's prefix-cache events, kept for the load streams that asked for them.

The engine thread appends what each step changed (EngineService); every load stream that asked
for cache events (grpc_server.py) reads from its own position. A stream starts with a snapshot of
every block held, taken on the engine thread together with the journal's position, so nothing is
lost or sent twice between the two. The journal is bounded: a stream that falls behind what it
keeps, or that sees the epoch change (the cache was cleared), starts over with a new snapshot,
which replaces what its receiver knew. The epoch is new at every start (random, never 0).

A stream's batches are cut to at most `max_ids` block ids, so that a large snapshot goes out over
several reports (the first one marked snapshot, the rest plain BlocksStored events): a load report
stays far below gRPC's message bound.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from fedllm_contract.cache_events import (
    AllBlocksCleared,
    BlocksStored,
    CacheEvent,
    CacheEventBatch,
)

# Block ids the journal keeps (~36 bytes each in Python); a reader further behind re-snapshots.
JOURNAL_IDS = 200_000
MAX_IDS_PER_REPORT = 65_536


@dataclass(frozen=True, slots=True)
class Snapshot:
    events: list[CacheEvent]
    position: int
    epoch: int


class CacheEventJournal:
    def __init__(self, block_size: int, max_ids: int = JOURNAL_IDS) -> None:
        self.block_size = block_size
        self._max_ids = max_ids
        self._lock = threading.Lock()
        self._events: deque[CacheEvent] = deque()
        self._ids = 0
        self._first = 0  # position of _events[0]
        self._epoch = _new_epoch()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """The position after the last event appended."""
        with self._lock:
            return self._first + len(self._events)

    def append(self, events: list[CacheEvent]) -> None:
        """Called on the engine thread with what the engine changed, in order."""
        with self._lock:
            kept, ids = self._events, self._ids
            # Inline (no call per event): a step at 1,024 sequences appends dozens of events.
            for event in events:
                if isinstance(event, AllBlocksCleared):
                    # Readers of the old epoch start over from a snapshot; nothing before matters.
                    self._first += len(kept)
                    kept.clear()
                    ids = 0
                    self._epoch = _new_epoch()
                    continue
                kept.append(event)
                ids += len(event.block_ids) or 1  # _weight
            self._ids = ids
            while self._ids > self._max_ids and self._events:
                dropped = self._events.popleft()
                self._ids -= _weight(dropped)
                self._first += 1

    def read(self, position: int, epoch: int) -> tuple[list[CacheEvent], int] | None:
        """The events from `position` on and the position after them; None if the journal no
        longer holds them or the epoch changed (the reader must take a new snapshot)."""
        with self._lock:
            if epoch != self._epoch or position < self._first:
                return None
            end = self._first + len(self._events)
            return list(self._events)[position - self._first :], end


def _new_epoch() -> int:
    return secrets.randbits(63) + 1


def _weight(event: CacheEvent) -> int:
    """What an event counts against a bound: its ids, and never less than one, so that a bound
    on ids also bounds the number of events."""
    return 1 if isinstance(event, AllBlocksCleared) else max(len(event.block_ids), 1)


class CacheEventStream:
    """One load stream's view of the journal: what it still has to send, and its batch count."""

    def __init__(
        self,
        journal: CacheEventJournal,
        snapshot: Callable[[], Awaitable[Snapshot]],
        max_ids: int = MAX_IDS_PER_REPORT,
    ) -> None:
        self._journal = journal
        self._snapshot = snapshot
        self._max_ids = max_ids
        self._backlog: deque[CacheEvent] = deque()
        self._position = 0
        self._epoch = 0
        self._sequence = 0

    async def next_batch(self) -> CacheEventBatch:
        """The events of the next report: a snapshot first (and again whenever the journal
        cannot continue this stream), then what changed, at most `max_ids` ids at a time."""
        snapshot = False
        if not self._backlog:
            read = self._journal.read(self._position, self._epoch) if self._epoch else None
            if read is None:
                taken = await self._snapshot()
                self._backlog = deque(taken.events)
                self._position, self._epoch, snapshot = taken.position, taken.epoch, True
            else:
                events, self._position = read
                self._backlog.extend(events)
        self._sequence += 1
        return CacheEventBatch(
            epoch=self._epoch,
            block_size=self._journal.block_size,
            snapshot=snapshot,
            sequence=self._sequence,
            events=self._take(),
        )

    def _take(self) -> tuple[CacheEvent, ...]:
        taken: list[CacheEvent] = []
        room = self._max_ids
        while self._backlog and room > 0:
            event = self._backlog.popleft()
            if not isinstance(event, AllBlocksCleared) and len(event.block_ids) > room:
                # Split a long run: the rest of a chain continues from the last id sent.
                head, rest = event.block_ids[:room], event.block_ids[room:]
                self._backlog.appendleft(
                    replace(event, block_ids=rest, parent=head[-1])
                    if isinstance(event, BlocksStored)
                    else replace(event, block_ids=rest)
                )
                event = replace(event, block_ids=head)
            taken.append(event)
            room -= _weight(event)
        return tuple(taken)
