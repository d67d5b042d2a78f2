"""Two servers never share a port: a site's gRPC server binds without SO_REUSEPORT (gRPC's
default sets it, and the kernel then splits connections between both servers, so a gateway could
reach another site's engine: seen in CI), and the ports devtools hands out for a process to bind
later come from outside the kernel's ephemeral range, in a slice per pytest-xdist worker."""

from __future__ import annotations

import asyncio

import pytest

from devtools import launch
from fedllm_contract.proto import site_pb2_grpc
from site_engine.grpc_server import start_server


def _servicer() -> site_pb2_grpc.SiteEngineServicer:
    # Every method answers UNIMPLEMENTED (the generated base class); only the binding is tested.
    return site_pb2_grpc.SiteEngineServicer()  # type: ignore[abstract]


def test_a_second_site_server_on_a_taken_port_fails_to_start() -> None:
    async def scenario() -> None:
        first, _, port = await start_server(_servicer(), "127.0.0.1", 0)
        try:
            with pytest.raises((OSError, RuntimeError), match="bind"):
                await start_server(_servicer(), "127.0.0.1", port)
        finally:
            await first.stop(None)

    asyncio.run(scenario())


@pytest.mark.parametrize(("worker", "count"), [("gw0", "2"), ("gw1", "2"), ("", "")])
def test_picked_ports_are_below_the_ephemeral_range_and_apart_per_worker(
    monkeypatch: pytest.MonkeyPatch, worker: str, count: str
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    ports = {launch.free_port() for _ in range(20)}
    assert len(ports) == 20  # a process's picks move on, not the same free port each time
    low, high = (20000, 26000) if worker == "gw0" else (26000, 32000) if worker else (20000, 32000)
    assert all(low <= port < high for port in ports), sorted(ports)
