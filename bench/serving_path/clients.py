"""Streaming clients of the gateway's `/v1/completions` in processes of their own (one event
loop each, uvloop where installed), on bench/serving_path/http_stream.py's connections.

- closed loop (`Job.closed`): `streams` connections, each sending its next request as soon as
  the last one ended (`retry_s` after one that was refused or cut), from a start staggered over
  `ramp_s` (so that the streams do not begin and end in waves), until `stop_s` (or, with
  `Job.once`, until its share of the list is sent); what is still open then may run `drain_s`
  more before it is cut.
- open loop: each request sent at its arrival offset on an idle connection (or a new one),
  whether or not earlier ones answered; what is still open `drain_s` after the last arrival is
  cut.

Times are `time.monotonic()`, one clock for every process of the machine. At each window start
in `Job.windows` a client notes how many text events each open answer had got, so that the
tokens a window delivered can be told from each answer's own usage (bench/serving_path/figures.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from bench.serving_path.http_stream import Answer, StreamConnection

HOST = "127.0.0.1"
# An idle connection older than this is not reused: the gateway closes idle ones after 5 s.
_STALE_S = 4.0


@dataclass(frozen=True, slots=True)
class Job:
    """What one client process sends: `requests` are whole HTTP requests (request_bytes); a
    closed loop sends requests[i % len] in turn, an open loop requests[i] at `at_s[i]`."""

    port: int
    requests: tuple[bytes, ...]
    start_s: float  # monotonic time the run starts at
    stop_s: float  # closed loop: no request is sent after; open loop: ignored
    drain_s: float
    streams: int = 0  # closed loop: concurrent streams
    ramp_s: float = 0.0
    retry_s: float = 1.0  # closed loop: the wait after an answer that did not complete
    at_s: tuple[float, ...] = ()  # open loop: offsets from start_s
    windows: tuple[float, ...] = ()  # monotonic window starts (and the last one's end)
    # Closed loop: every request sent once (stream s sends s, s + streams, ...; it stops when
    # its share is sent) instead of each stream cycling the list from its own start. A prompt
    # sent twice is in the sites' prefix caches the second time (bench.federation_real's
    # capacity phase must not count prefills that never ran).
    once: bool = False

    @property
    def closed(self) -> bool:
        return self.streams > 0


@dataclass(slots=True)
class Sent:
    """One request and its answer; `index` is its position in the job's list."""

    index: int
    sent_s: float
    answer: Answer = field(default_factory=Answer)
    cut: bool = False  # still open at the end: the client closed it


class _Client:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.sent: list[Sent] = []
        self.open: dict[int, Sent] = {}  # by id(Sent): open answers, for the window marks
        self.idle: list[StreamConnection] = []

    def mark(self, window: int) -> None:
        for item in self.open.values():
            item.answer.marks[window] = item.answer.events

    async def send(self, connection: StreamConnection, index: int, request: bytes) -> Sent:
        item = Sent(index, time.monotonic())
        self.sent.append(item)
        self.open[id(item)] = item
        try:
            await connection.post(request, item.answer)
        except (ConnectionError, OSError) as exc:
            item.answer.error = f"{type(exc).__name__}: {exc}"[:300]
            item.answer.end_s = time.monotonic()
        except asyncio.CancelledError:
            item.cut = True
            item.answer.end_s = time.monotonic()
            connection.close()
            raise
        finally:
            del self.open[id(item)]
        return item

    async def stream(self, number: int) -> None:
        """Closed loop: one connection's requests, one after the other."""
        job = self.job
        await _sleep_until(job.start_s + job.ramp_s * number / job.streams)
        connection: StreamConnection | None = None
        sent = 0
        while time.monotonic() < job.stop_s:
            if connection is None or connection.closed:
                try:
                    connection = await StreamConnection.open(HOST, job.port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
            if job.once:
                index = number + sent * job.streams
                if index >= len(job.requests):
                    return
            else:
                index = (number + sent) % len(job.requests)
            item = await self.send(connection, index, job.requests[index])
            sent += 1
            if not item.answer.complete:
                # As a client library backs off: a refusal answered at once must not turn the
                # stream into a storm of requests that only measures refusing.
                await asyncio.sleep(job.retry_s)

    async def arrival(self, index: int) -> None:
        """Open loop: request `index` at its offset."""
        job = self.job
        await _sleep_until(job.start_s + job.at_s[index])
        connection = await self.connection()
        item = await self.send(connection, index, job.requests[index])
        if not connection.closed and item.answer.error is None:
            self.idle.append(connection)

    async def connection(self) -> StreamConnection:
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and time.monotonic() - connection.idle_since < _STALE_S:
                return connection
            connection.close()
        return await StreamConnection.open(HOST, self.job.port)

    async def run(self) -> None:
        job = self.job
        loop = asyncio.get_running_loop()
        for window, at in enumerate(job.windows):
            loop.call_at(loop.time() + at - time.monotonic(), self.mark, window)
        if job.closed:
            tasks = [asyncio.create_task(self.stream(n)) for n in range(job.streams)]
            deadline = job.stop_s + job.drain_s
        else:
            tasks = [asyncio.create_task(self.arrival(i)) for i in range(len(job.requests))]
            deadline = job.start_s + max(job.at_s, default=0.0) + job.drain_s
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for connection in self.idle:
            connection.close()


async def _sleep_until(at: float) -> None:
    wait = at - time.monotonic()
    if wait > 0:
        await asyncio.sleep(wait)


def _client_main(job: Job, out: Connection) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    client = _Client(job)
    asyncio.run(client.run())
    # Its own CPU seconds: it exits before a sampler could read them from outside.
    out.send((client.sent, time.process_time()))
    out.close()


@dataclass
class ClientProcesses:
    """The client processes of one run: started at once, their requests gathered at the end."""

    jobs: Sequence[Job]
    processes: list[multiprocessing.process.BaseProcess] = field(default_factory=list)
    pipes: list[Connection] = field(default_factory=list)

    def start(self) -> None:
        context = multiprocessing.get_context("fork")
        for job in self.jobs:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_client_main, args=(job, send), daemon=True)
            process.start()
            send.close()
            self.processes.append(process)
            self.pipes.append(receive)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def gather(self, timeout_s: float) -> list[tuple[list[Sent], float]]:
        """Every process's requests and its CPU seconds, once each has ended (within
        `timeout_s`)."""
        results: list[tuple[list[Sent], float]] = []
        deadline = time.monotonic() + timeout_s
        for process, pipe in zip(self.processes, self.pipes, strict=True):
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"client process {process.pid} did not end in time")
            results.append(pipe.recv())
            process.join(timeout=10)
        return results

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
