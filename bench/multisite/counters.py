"""Reading each site's engine counters from its own load report (through the gateway's gRPC
adapter), so a run's iterations and KV use are differences between two readings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView, SiteUnavailable

_REPORT_INTERVAL_MS = 50


@dataclass(frozen=True, slots=True)
class SiteCounters:
    """Cumulative since the site started, plus what it held when read."""

    iterations: int
    kv_block_iterations: int
    kv_token_iterations: int
    queued: int = 0
    running: int = 0

    @classmethod
    def of(cls, report: LoadView) -> SiteCounters:
        return cls(
            report.iterations,
            report.kv_block_iterations,
            report.kv_token_iterations,
            report.queued_requests,
            report.running_requests,
        )

    @property
    def busy(self) -> bool:
        return self.queued + self.running > 0

    def minus(self, earlier: SiteCounters) -> SiteCounters:
        return SiteCounters(
            self.iterations - earlier.iterations,
            self.kv_block_iterations - earlier.kv_block_iterations,
            self.kv_token_iterations - earlier.kv_token_iterations,
            self.queued,
            self.running,
        )


async def _read_one(name: str, endpoint: str, attempts: int = 3) -> SiteCounters:
    """One report; a stream that breaks is opened again (the counters are cumulative, so a
    later report is as good)."""
    client = GrpcSiteClient(name, endpoint, connect_timeout_s=10)
    try:
        for attempt in range(attempts):
            try:
                async for report in client.load_reports(_REPORT_INTERVAL_MS):
                    return SiteCounters.of(report)
            except SiteUnavailable:
                if attempt + 1 == attempts:
                    raise
                await asyncio.sleep(0.2)
        raise RuntimeError(f"site {name} closed its load report stream")
    finally:
        await client.close()


async def read_counters(endpoints: Mapping[str, str]) -> dict[str, SiteCounters]:
    """One load report from each site (name -> endpoint)."""
    names = list(endpoints)
    readings = await asyncio.gather(*(_read_one(n, endpoints[n]) for n in names))
    return dict(zip(names, readings, strict=True))


async def settled_counters(
    endpoints: Mapping[str, str], timeout_s: float = 120.0
) -> dict[str, SiteCounters]:
    """Counters once every site is idle and two readings agree (the last step has been
    accounted for)."""
    deadline = time.monotonic() + timeout_s
    previous = await read_counters(endpoints)
    while True:
        await asyncio.sleep(0.1)
        current = await read_counters(endpoints)
        if current == previous and not any(c.busy for c in current.values()):
            return current
        if time.monotonic() > deadline:
            busy = sorted(name for name, c in current.items() if c.busy)
            raise RuntimeError(f"sites did not settle in {timeout_s:.0f}s (busy: {busy})")
        previous = current
