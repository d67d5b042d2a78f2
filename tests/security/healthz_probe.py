"""Probing `/healthz` while an attack runs: the slowest answer says how long the event loop was
held (a load balancer fails a target whose health check stalls).

On a busy machine `/healthz` is slow for reasons that are not the gateway's (CI at load 6-9 saw
0.84 s with the loop free, issue 67), so a test can judge the slowest answer against the same
gateway's slowest answer just before, with nothing else sent (stall_limit_s)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx


@dataclass
class Probe:
    worst_s: float = 0.0
    answers: int = 0


@contextmanager
def probing_healthz(
    base_url: str, every_s: float = 0.05, client: httpx.Client | None = None
) -> Iterator[Probe]:
    """Asks `/healthz` over and over until the block ends; `worst_s` is the slowest answer.
    `client`: one to ask through (a litestar TestClient's app in this process), else a new
    one."""
    probe, done = Probe(), threading.Event()

    def ask(client: httpx.Client) -> None:
        while not done.is_set():
            started = time.monotonic()
            assert client.get(f"{base_url}/healthz").status_code == 200
            probe.worst_s = max(probe.worst_s, time.monotonic() - started)
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


def quiet_worst_s(base_url: str, seconds: float = 3.0, every_s: float = 0.05) -> float:
    """The slowest `/healthz` answer over `seconds` with nothing else sent: what this machine's
    load alone costs an answer now."""
    with probing_healthz(base_url, every_s) as probe:
        time.sleep(seconds)
    return probe.worst_s


def stall_limit_s(quiet_s: float) -> float:
    """The slowest `/healthz` a test allows, given the quiet gateway's slowest answer."""
    return max(STALL_FLOOR_S, STALL_FACTOR * quiet_s)
