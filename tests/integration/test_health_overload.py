"""Real CPU sites over real gRPC: a site with thousands of requests queued stays healthy to the
gateway's health monitor, whose event loop also carries those requests' streams (as the
gateway's does), while a killed site is marked down at its next check."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.launch import ManagedProcess, start_site
from gateway.federation import SiteConfig
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.health import HealthMonitor
from gateway.sites.interface import GenerateParams, SiteCallError
from gateway.sites.load_reports import LoadReportListener
from gateway.sites.registry import SiteRegistry, SiteState

pytestmark = pytest.mark.slow
STREAMS = 2000


@pytest.fixture
def sites(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    started = [
        start_site(
            model_dir=tiny_llama_dir,
            site_name=name,
            model_name="tiny",
            log_dir=tmp_path,
            extra_args=["--max-num-seqs", "8", "--max-queued-requests", str(STREAMS * 2)],
        )
        for name in ("busy", "doomed")
    ]
    yield started
    for process in started:
        process.stop()


def _state(process: ManagedProcess, name: str, site_id: int) -> SiteState:
    endpoint = f"127.0.0.1:{process.port}"
    config = SiteConfig(name, "aws", "r", endpoint, "tiny")
    return SiteState(config, site_id, GrpcSiteClient(name, endpoint, 2.0))


async def _stream(site: SiteState, i: int) -> None:
    params = GenerateParams(f"flood-{i}", tuple((i * 7 + j) % 5000 + 10 for j in range(32)), 512)
    with contextlib.suppress(SiteCallError):
        async for _chunk in site.client.generate(params, 120.0):
            pass


def test_an_overloaded_site_stays_healthy_and_a_killed_one_goes_down_at_once(
    sites: list[ManagedProcess],
) -> None:
    async def exercise() -> None:
        busy, doomed = _state(sites[0], "busy", 1), _state(sites[1], "doomed", 2)
        registry = SiteRegistry([busy, doomed])
        listener = LoadReportListener(registry, 250, 5.0)
        monitor = HealthMonitor(registry, {}, 0.25, listener.stale, failures_to_down=3)
        following = asyncio.create_task(listener.run())
        await monitor.check_once()
        assert busy.healthy
        assert doomed.healthy
        flood = [asyncio.create_task(_stream(busy, i)) for i in range(STREAMS)]
        try:
            deadline = time.monotonic() + 60
            while (busy.report is None or busy.report.queued_requests < 1000) and (
                time.monotonic() < deadline
            ):
                await monitor.check_once()
                assert busy.healthy, busy.last_error
                await asyncio.sleep(0.25)
            assert busy.report is not None
            assert busy.report.queued_requests >= 1000
            for _ in range(20):  # ~5 s deep in overload
                await monitor.check_once()
                assert busy.healthy, busy.last_error
                await asyncio.sleep(0.25)
            sites[1].kill()
            killed = time.monotonic()
            while doomed.healthy and time.monotonic() - killed < 10:
                await monitor.check_once()
                await asyncio.sleep(0.25)
            assert not doomed.healthy
            assert time.monotonic() - killed < 3.0, "a refused check must act at once"
            assert "refused" in (doomed.last_error or "")
            assert busy.healthy, busy.last_error
        finally:
            for task in (*flood, following):
                task.cancel()
            await asyncio.gather(*flood, following, return_exceptions=True)
            await registry.close()

    asyncio.run(exercise())
