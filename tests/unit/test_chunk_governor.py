"""The chunk budget under a busy event loop (gateway/sites/chunk_governor.py): the controller,
the pacer's interval, the loop check on a real asyncio loop, and the setting's bounds."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from gateway.settings import GatewaySettings, SettingsError
from gateway.sites.chunk_governor import CUT, GROW, LAG_HIGH_S, ChunkGovernor, govern
from gateway.sites.grpc_generate_stream import ChunkPacer

FEDERATION = {"GATEWAY_FEDERATION_FILE": "f.json"}


def test_a_late_check_cuts_the_share_to_its_floor_and_checks_with_room_grow_it_back() -> None:
    governor = ChunkGovernor(floor=0.125)
    assert governor.observe(0.02) == pytest.approx(CUT)
    for _ in range(10):
        governor.observe(LAG_HIGH_S * 2)
    assert governor.share == 0.125  # never below the floor
    governor.observe(0.003)  # between the bounds: held
    assert governor.share == 0.125
    assert governor.observe(0.0) == pytest.approx(0.125 * GROW)
    for _ in range(40):
        governor.observe(0.0005)
    assert governor.share == 1.0  # never above the whole budget


def test_a_floor_of_the_whole_budget_never_moves_and_a_floor_outside_a_share_is_refused() -> None:
    fixed = ChunkGovernor(floor=1.0)
    assert fixed.observe(1.0) == 1.0
    for floor in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="floor"):
            ChunkGovernor(floor=floor)


def test_the_pacer_s_interval_is_its_streams_over_the_budget_s_share() -> None:
    pacer = ChunkPacer(8000.0)
    pacer.streams = 800
    assert pacer.interval_s() == pytest.approx(0.1)
    pacer.share = 0.125
    assert pacer.interval_s() == pytest.approx(0.8)
    assert ChunkPacer(0.0).interval_s() == 0.0  # no bound: no interval whatever the share


def _hold_the_loop(seconds: float) -> None:
    """Work that keeps the event loop's thread (a busy gateway's chunks and requests)."""
    time.sleep(seconds)


def test_a_loop_blocked_past_the_check_cuts_the_pacer_s_share() -> None:
    pacer = ChunkPacer(8000.0)

    async def blocked_once() -> None:
        task = asyncio.create_task(govern(pacer, ChunkGovernor(floor=0.125), period_s=0.01))
        try:
            await asyncio.sleep(0)  # the governor's first sleep begins
            _hold_the_loop(0.05)  # its check wakes >= 40 ms late
            for _ in range(100):
                await asyncio.sleep(0.005)
                if pacer.share < 1.0:
                    break
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(blocked_once())
    # One late check: one cut (a later check with room may have grown it back a step).
    assert pacer.share in (pytest.approx(CUT), pytest.approx(CUT * GROW))


@pytest.mark.parametrize("minimum", ["-1", "9000"])
def test_a_floor_outside_the_budget_is_refused(minimum: str) -> None:
    env = FEDERATION | {
        "GATEWAY_STREAM_CHUNKS_PER_S": "8000",
        "GATEWAY_STREAM_CHUNKS_MIN_PER_S": minimum,
    }
    with pytest.raises(SettingsError, match="GATEWAY_STREAM_CHUNKS_MIN_PER_S"):
        GatewaySettings.from_env(env)


def test_the_floor_is_read_off_by_default_and_ignored_without_a_budget() -> None:
    assert GatewaySettings.from_env(FEDERATION).sites.stream_chunks_min_per_s == 0.0
    env = FEDERATION | {"GATEWAY_STREAM_CHUNKS_MIN_PER_S": "2000"}
    assert GatewaySettings.from_env(env).sites.stream_chunks_min_per_s == 2000.0
    unbounded = FEDERATION | {
        "GATEWAY_STREAM_CHUNKS_PER_S": "0",
        "GATEWAY_STREAM_CHUNKS_MIN_PER_S": "9000",
    }
    assert GatewaySettings.from_env(unbounded).sites.stream_chunks_per_s == 0.0
