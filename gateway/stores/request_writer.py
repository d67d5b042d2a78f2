"""The request log, written behind the requests: a request's row, its offloads, its outcome and
its length sample are queued in memory when they happen and written in batches, many requests
per transaction, at most `flush_s` later.

Writing them inline cost two transactions per request (and the sample) on the request's path,
about 40 % of the gateway's CPU. Here a request that ends before its row was written costs one
insert, and a batch of requests one transaction.

What is queued is never given up while the gateway runs: a batch the database refuses (it is
restarting, failing over, refusing connections) goes back to the front of the queue and is
written again, backing off from 0.5 s to 10 s. Memory is bounded: at most `capacity` requests
wait (the gateway takes no new request while it is full: the request path's admit stage,
gateway/request_path/admit.py, answers 503, so what it has accepted is never dropped), and
length samples (retraining data, not accounting) are dropped once the waiting ones pass
`sample_bytes`. A row the database refuses for what it holds
(not for being away) is written alone and, if refused again, logged and dropped, so that it
cannot hold every other request's row back; before it is dropped it is written once more without
its free-form columns (`user`, routing and error details) and its length sample, so that a
request is billed whatever text it carried. /metrics shows the queue
(fedllm_gateway_outcome_backlog, fedllm_gateway_outcome_backlog_oldest_seconds); at shutdown it
is written out, and what the database still refuses is logged request by request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from gateway.db.models import utcnow
from gateway.stores.request_log import (
    LogBatch,
    NewRequest,
    NewSample,
    Outcome,
    RequestLog,
    accounting_only,
    outcome_values,
    request_row,
    sample_row,
)

log = logging.getLogger(__name__)
RETRY_FIRST_S = 0.5
RETRY_MOST_S = 10.0
# The database is away (retry the batch), as opposed to refusing what a row holds.
_AWAY = (OperationalError, InterfaceError, PoolTimeoutError, OSError)


@dataclass(slots=True)
class _Entry:
    """One request's writes that the database has not taken yet."""

    request_id: str
    first_seq: int
    since: float
    row: dict[str, Any] | None = None  # its row, not inserted yet
    outcome: dict[str, Any] | None = None
    sample: dict[str, Any] | None = None
    offloads: list[dict[str, Any]] = field(default_factory=list)
    moved_to: int | None = None  # its written row's site since an offload (no outcome yet)

    def absorb(self, newer: _Entry) -> None:
        """Takes the writes of `newer`, made after this entry's."""
        self.offloads.extend(newer.offloads)
        if newer.moved_to is not None:
            self.move(newer.moved_to)
        if newer.outcome is not None:
            self.outcome, self.moved_to = newer.outcome, None
            self.sample = newer.sample or self.sample

    def move(self, site_id: int) -> None:
        if self.row is not None:
            self.row["site_id"] = site_id
        elif self.outcome is None:
            self.moved_to = site_id

    def sample_size(self) -> int:
        return len(self.sample["prompt"].encode()) if self.sample is not None else 0

    def for_accounting(self) -> _Entry:
        """The same writes less what a database may refuse for its content: the free-form
        columns and the length sample (retraining data, not accounting)."""
        return _Entry(
            self.request_id,
            self.first_seq,
            self.since,
            row=accounting_only(self.row),
            outcome=accounting_only(self.outcome),
            offloads=self.offloads,
            moved_to=self.moved_to,
        )


def _batch(entries: Iterable[_Entry]) -> LogBatch:
    batch = LogBatch()
    for entry in entries:
        if entry.row is not None:
            batch.inserts.append(entry.row | (entry.outcome or {}))
        elif entry.outcome is not None:
            batch.outcomes.append({f"b_{k}": v for k, v in entry.outcome.items()})
            batch.outcomes[-1]["b_id"] = entry.request_id
        batch.offloads.extend(entry.offloads)
        if entry.moved_to is not None:
            batch.moves.append({"b_id": entry.request_id, "b_site_id": entry.moved_to})
        if entry.sample is not None:
            batch.samples.append(entry.sample)
    return batch


class RequestLogWriter:
    def __init__(
        self,
        request_log: RequestLog,
        capacity: int = 100_000,
        *,
        flush_s: float = 0.02,
        batch_rows: int = 500,
        sample_bytes: int = 16 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._request_log = request_log
        self.capacity = capacity
        self._flush_s = flush_s
        self._batch_rows = batch_rows
        self._sample_budget = sample_bytes
        self._sample_bytes = 0
        self._clock = clock
        self._pending: dict[str, _Entry] = {}
        self._in_flight: list[_Entry] = []
        self._seq = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        # Resolved when the writer, gathering writes, should write at once.
        self._wake: asyncio.Future[None] | None = None
        self._closing = False
        self.failures = 0

    def __len__(self) -> int:
        """Requests with writes the database has not taken yet."""
        return len(self._pending) + len(self._in_flight)

    @property
    def full(self) -> bool:
        return len(self) >= self.capacity

    def oldest_s(self) -> float:
        """How long the oldest write not taken yet has waited (0 when none does)."""
        oldest = self._in_flight[0] if self._in_flight else next(iter(self._pending.values()), None)
        return self._clock() - oldest.since if oldest is not None else 0.0

    def accepted(self, new: NewRequest) -> None:
        self._entry(new.request_id).row = request_row(new, utcnow())

    def finished(self, request_id: str, outcome: Outcome, sample: NewSample | None = None) -> None:
        now = utcnow()
        entry = self._entry(request_id)
        entry.outcome, entry.moved_to = outcome_values(outcome, now), None
        if sample is not None:
            size = len(sample.prompt.encode())
            if self._sample_bytes + size <= self._sample_budget:
                self._sample_bytes += size - entry.sample_size()
                entry.sample = sample_row(request_id, sample, now)

    def offloaded(self, request_id: str, from_site_id: int, to_site_id: int) -> None:
        entry = self._entry(request_id)
        event = {"request_id": request_id, "from_site_id": from_site_id, "to_site_id": to_site_id}
        entry.offloads.append(event | {"created_at": utcnow()})
        entry.move(to_site_id)

    def _entry(self, request_id: str) -> _Entry:
        self._seq += 1
        entry = self._pending.get(request_id)
        if entry is None:
            entry = self._pending[request_id] = _Entry(request_id, self._seq, self._clock())
            if len(self._pending) >= self._batch_rows:
                self._write_now()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all(), name="request-log-writer")
        return entry

    def _write_now(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def flush(self) -> None:
        """Returns once every write made before the call is in the database (waiting while the
        database refuses it)."""
        if not len(self):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((self._seq, future))
        self._write_now()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all(), name="request-log-writer")
        await future

    async def settle(self, timeout_s: float) -> None:
        """flush(), for at most `timeout_s`: a reader of the request log (usage per key) sees
        the requests answered before it asked, and is not held by a database that refuses
        writes."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), timeout_s)

    async def _write_all(self) -> None:
        delay = RETRY_FIRST_S
        while self._pending:
            if len(self._pending) < self._batch_rows and not (self._waiters or self._closing):
                await self._gather()
            self._in_flight = list(self._pending.values())[: self._batch_rows]
            for entry in self._in_flight:
                del self._pending[entry.request_id]
            try:
                await self._write_in_flight()
            except (*_AWAY, asyncio.CancelledError) as exc:
                self._put_back(self._in_flight)
                self._in_flight = []
                if isinstance(exc, asyncio.CancelledError):
                    raise
                self._refused(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MOST_S)
                continue
            delay = RETRY_FIRST_S
            self._wake_waiters()
        self._wake_waiters()

    async def _gather(self) -> None:
        """Waits flush_s for more writes (less if a batch fills or flush() is called)."""
        loop = asyncio.get_running_loop()
        self._wake = wake = loop.create_future()
        timer = loop.call_later(self._flush_s, self._write_now)
        try:
            await wake
        finally:
            timer.cancel()
            self._wake = None

    async def _write_in_flight(self) -> None:
        """Writes the entries taken in one transaction; when the database refuses what one of
        them holds, each alone, dropping those it refuses again (one bad row must not hold
        every other request's back)."""
        try:
            await self._request_log.write(_batch(self._in_flight))
        except _AWAY:
            raise
        except SQLAlchemyError:
            await self._write_one_by_one()
            return
        self._sample_bytes -= sum(entry.sample_size() for entry in self._in_flight)
        self._in_flight = []

    async def _write_one_by_one(self) -> None:
        while self._in_flight:
            entry = self._in_flight[0]
            for attempt in (entry, entry.for_accounting()):
                try:
                    await self._request_log.write(_batch([attempt]))
                    break
                except _AWAY:
                    raise
                except SQLAlchemyError:
                    if attempt is not entry:
                        log.exception("the request log refused %s; dropped", entry.request_id)
                    else:
                        log.warning(
                            "the request log refused %s for what it holds; writing its usage "
                            "without its free-form columns",
                            entry.request_id,
                        )
            self._sample_bytes -= entry.sample_size()
            self._in_flight.pop(0)

    def _put_back(self, entries: list[_Entry]) -> None:
        """Entries of a refused batch go back in front of the writes made since."""
        restored = {entry.request_id: entry for entry in entries}
        for request_id, newer in self._pending.items():
            if request_id in restored:
                restored[request_id].absorb(newer)
            else:
                restored[request_id] = newer
        self._pending = restored

    def _refused(self, exc: BaseException) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning(
                "the request log refuses writes (%s): %d requests waiting, the oldest for %.0fs",
                type(exc).__name__,
                len(self),
                self.oldest_s(),
            )

    def _wake_waiters(self) -> None:
        first = next(iter(self._pending.values()), None)
        written_up_to = first.first_seq - 1 if first is not None else self._seq
        waiting = []
        for seq, future in self._waiters:
            if seq > written_up_to:
                waiting.append((seq, future))
            elif not future.done():
                future.set_result(None)
        self._waiters = waiting

    async def drain(self, timeout_s: float) -> None:
        """At shutdown: writes what is queued, waiting up to `timeout_s` for a database that
        refuses it, then logs what could not be written, so that an operator can account for
        it."""
        self._closing = True
        self._write_now()
        writer = self._writer
        if writer is not None and not writer.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(writer), timeout_s)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        for left in [*self._in_flight, *self._pending.values()]:
            outcome = left.outcome or {}
            status = outcome.get("status")
            log.error(
                "writes of %s never made (the database refused them until shutdown): %s, "
                "%s completion tokens",
                left.request_id,
                "accepted" if status is None else status.value,
                outcome.get("completion_tokens"),
            )
