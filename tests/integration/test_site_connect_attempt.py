"""A site slow to open its connection (across a wide-area link, or busy for a moment) gets the
whole control deadline to send its HTTP/2 SETTINGS before calls to it fail; a site that is down
still fails them at once. gRPC core reads its min_reconnect_backoff_ms as the floor of each
connection attempt, and 200 ms there once failed a lending call to a freshly started CPU site."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import HealthAnswer, SiteUnavailable

CONNECT_S = 1.5


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """Accepts TCP (the kernel does) and never answers: an attempt ends only at its deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def _closed_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_slow_connection_gets_the_control_deadline_before_calls_fail(
    silent_listener: str,
) -> None:
    async def run() -> float:
        client = GrpcSiteClient("slow", silent_listener, CONNECT_S)
        began = time.monotonic()
        with pytest.raises(SiteUnavailable):
            await client.kv_room()  # its own deadline is far longer: the attempt ends it
        return time.monotonic() - began

    assert asyncio.run(run()) >= CONNECT_S * 0.9


def test_a_site_that_is_down_is_refused_at_once() -> None:
    async def run() -> tuple[HealthAnswer, float]:
        client = GrpcSiteClient("down", _closed_port(), CONNECT_S)
        began = time.monotonic()
        answer = await client.check_health()
        return answer, time.monotonic() - began

    answer, took = asyncio.run(run())
    assert answer is HealthAnswer.REFUSED
    assert took < CONNECT_S / 2
