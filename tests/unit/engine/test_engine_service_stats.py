"""The site's cumulative KV use (what the load report carries for benchmarks): a running sum of
the KV held after each iteration."""

from __future__ import annotations

from site_engine.engine.api import EngineStats
from site_engine.engine_service import CumulativeKv


def stats(blocks: int, tokens: int, iterations: int) -> EngineStats:
    return EngineStats(0, 1, 0, tokens, 0, blocks, 100, iterations)


def test_cumulative_kv_adds_what_each_iteration_held() -> None:
    total = CumulativeKv()
    for blocks, tokens, iteration in [(2, 20, 1), (3, 40, 2), (0, 0, 3)]:
        total = total.after(stats(blocks, tokens, iteration))
    assert total == CumulativeKv(block_iterations=5, token_iterations=60)


def test_cumulative_kv_is_a_value_each_step_replaces() -> None:
    start = CumulativeKv()
    later = start.after(stats(1, 16, 1))
    assert start == CumulativeKv()  # readers on another thread never see a half-updated pair
    assert later == CumulativeKv(1, 16)
