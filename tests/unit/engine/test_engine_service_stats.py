"""What the engine service reports in load reports: cumulative KV use (a running sum of the KV
held after each iteration) and the decode rate, read from another thread than the one that
updates them."""

from __future__ import annotations

import threading

from site_engine.engine.api import EngineStats
from site_engine.engine_service import CumulativeKv, _Throughput


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


def test_decode_rate_counts_the_window() -> None:
    rate = _Throughput()
    for second in range(10):
        rate.add(float(second), 4, 0.5)
    assert rate.rate(9.0) == 3 * 4 / 1.5  # steps ending at 7, 8 and 9 s are within 2 s of 9 s


def test_decode_rate_leaves_idle_time_out() -> None:
    """A site that answered one short request and went idle steps as fast as it did, not as fast
    as 6 tokens spread over the whole window."""
    rate = _Throughput()
    for i in range(6):
        rate.add(10.0 + 0.01 * i, 1, 0.01)
    assert abs(rate.rate(11.5) - 100.0) < 1e-6
    assert rate.rate(13.0) == 0.0  # nothing in the window: nothing to say


def test_prefill_steps_count_as_busy_time() -> None:
    rate = _Throughput()
    rate.add(1.0, 0, 0.3)  # a prefill chunk: no token out, the engine busy all the same
    rate.add(1.1, 4, 0.1)
    assert abs(rate.rate(1.1) - 10.0) < 1e-9


def test_decode_rate_can_be_read_while_the_engine_thread_adds() -> None:
    """The load report reads the rate on the asyncio thread while the engine thread appends and
    trims; reading used to fail with "deque mutated during iteration"."""
    rate = _Throughput()
    done = threading.Event()

    def engine_thread() -> None:
        for i in range(200_000):
            rate.add(i * 1e-4, 1, 1e-4)
        done.set()

    writer = threading.Thread(target=engine_thread)
    writer.start()
    reads = 0
    while not done.is_set():
        assert rate.rate(reads * 1e-4) >= 0.0
        reads += 1
    writer.join()
    assert reads > 0
