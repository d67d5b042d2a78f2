"""Probing `/healthz` while an attack runs: the slowest answer says how long the event loop was
held (a load balancer fails a target whose health check stalls).

On a busy machine `/healthz` is slow for reasons that are not the gateway's (CI at load 6-9 saw
0.84 s with the loop free, issue 67), so a test can judge the slowest answer against the same
gateway's slowest answer just before, with nothing else sent (stall_limit_s).

Nor is every slow answer the gateway's when the load changes after that: a CI run saw one answer
take 1.56 s while the gateway did ~40 ms of work in all for the test's eight requests (a py-spy
profile of the same test), the machine at load 3.6 and the test's own process (4 GB, shared by a
prober and four senders) free to pause. Given the gateway's pid, each answer is judged by no more
than the CPU time the gateway's process (every thread) spent while it waited: a loop held by work
spends the CPU it holds the loop for, a gateway waiting for a CPU or for its client spends none."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import psutil


@dataclass
class Probe:
    """`worst_s`: the slowest answer as judged (its wall time, bounded by the server's CPU time
    meanwhile where its pid is known); `worst_wall_s`: the slowest answer's wall time."""

    worst_s: float = 0.0
    answers: int = 0
    worst_wall_s: float = 0.0


def _cpu_s(process: psutil.Process | None) -> float:
    if process is None:
        return 0.0
    times = process.cpu_times()
    return float(times.user + times.system)


@contextmanager
def probing_healthz(
    base_url: str,
    every_s: float = 0.05,
    client: httpx.Client | None = None,
    server_pid: int | None = None,
) -> Iterator[Probe]:
    """Asks `/healthz` over and over until the block ends; `worst_s` is the slowest answer.
    `client`: one to ask through (a litestar TestClient's app in this process), else a new
    one. `server_pid`: the gateway's process, whose CPU time bounds each answer's."""
    probe, done = Probe(), threading.Event()
    server = psutil.Process(server_pid) if server_pid is not None else None

    def ask(client: httpx.Client) -> None:
        while not done.is_set():
            started, cpu = time.monotonic(), _cpu_s(server)
            assert client.get(f"{base_url}/healthz").status_code == 200
            wall_s = time.monotonic() - started
            judged_s = wall_s if server is None else min(wall_s, _cpu_s(server) - cpu)
            probe.worst_s = max(probe.worst_s, judged_s)
            probe.worst_wall_s = max(probe.worst_wall_s, wall_s)
            probe.answers += 1
            time.sleep(every_s)

    def run() -> None:
        if client is not None:
            ask(client)
            return
        with httpx.Client(timeout=30) as own:
            ask(own)

    prober = threading.Thread(target=run)
    prober.start()
    try:
        yield probe
    finally:
        done.set()
        prober.join()


# A stalled loop shows as seconds (a 1 MB prompt tokenized on the loop held it 1-2 s each); the
# bound is this, or this many times the quiet gateway's slowest answer on a busy machine.
STALL_FLOOR_S = 0.5
STALL_FACTOR = 5.0


def quiet_worst_s(
    base_url: str, seconds: float = 3.0, every_s: float = 0.05, server_pid: int | None = None
) -> float:
    """The slowest `/healthz` answer over `seconds` with nothing else sent: what this machine's
    load alone costs an answer now (judged as probing_healthz judges, given `server_pid`)."""
    with probing_healthz(base_url, every_s, server_pid=server_pid) as probe:
        time.sleep(seconds)
    return probe.worst_s


def stall_limit_s(quiet_s: float) -> float:
    """The slowest `/healthz` a test allows, given the quiet gateway's slowest answer."""
    return max(STALL_FLOOR_S, STALL_FACTOR * quiet_s)
