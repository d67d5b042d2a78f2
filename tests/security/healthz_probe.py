"""Probing `/healthz` while an attack runs: the slowest answer says how long the event loop was
held (a load balancer fails a target whose health check stalls)."""

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
