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


@contextmanager
def probing_healthz(base_url: str, every_s: float = 0.05) -> Iterator[Probe]:
    """Asks `/healthz` over and over until the block ends; `worst_s` is the slowest answer."""
    probe, done = Probe(), threading.Event()

    def run() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get(f"{base_url}/healthz").status_code == 200
                probe.worst_s = max(probe.worst_s, time.monotonic() - started)
                time.sleep(every_s)

    prober = threading.Thread(target=run)
    prober.start()
    try:
        yield probe
    finally:
        done.set()
        prober.join()
