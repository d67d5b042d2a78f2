"""What the engine service reports in load reports: cumulative KV use (a running sum of the KV
held after each iteration) and the decode and prefill rates, read from another thread than the
one that updates them."""

from __future__ import annotations

import threading

from site_engine.engine.core.api import EngineStats
from site_engine.engine_service import CumulativeKv
from site_engine.step_rates import StepRates, StepWork


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


def step(ended: float, busy_s: float, decoded: int = 0, prefilled: int = 0) -> StepWork:
    return StepWork(ended, busy_s, decoded, decoding=decoded > 0, prefilled=prefilled)


def test_decode_rate_counts_the_window() -> None:
    rates = StepRates()
    for second in range(10):
        rates.add(step(float(second), 0.5, decoded=4))
    # steps ending at 7, 8 and 9 s are within 2 s of 9 s
    assert rates.decode_tokens_per_s(9.0) == 3 * 4 / 1.5


def test_decode_rate_leaves_idle_time_out() -> None:
    """A site that answered one short request and went idle steps as fast as it did, not as fast
    as 6 tokens spread over the whole window."""
    rates = StepRates()
    for i in range(6):
        rates.add(step(10.0 + 0.01 * i, 0.01, decoded=1))
    assert abs(rates.decode_tokens_per_s(11.5) - 100.0) < 1e-6
    assert rates.decode_tokens_per_s(13.0) == 0.0  # nothing in the window: nothing to say


def test_a_lone_prefill_is_not_a_decode_step() -> None:
    """A conversation's first turn: a 300 ms prefill that emits the first token, then 10 ms
    decode steps. Counted as a decode step, the prefill made the site that holds the prefix read
    as 6x slower than it steps, and its next turn went elsewhere."""
    rates = StepRates()
    rates.add(StepWork(1.0, 0.3, decoded=0, decoding=False, prefilled=3000))
    for i in range(5):
        rates.add(step(1.01 + 0.01 * i, 0.01, decoded=1))
    assert abs(rates.decode_tokens_per_s(1.1) - 100.0) < 1e-6
    assert abs(rates.prefill_tokens_per_s(1.1) - 10_000.0) < 1e-6


def test_a_prefill_next_to_decoding_sequences_counts_for_both() -> None:
    """Chunked prefill beside running sequences: they wait the whole step, so it is a (slow)
    decode step; and it is a prefill step too."""
    rates = StepRates()
    rates.add(StepWork(1.0, 0.3, decoded=0, decoding=True, prefilled=2000))  # decoders waited
    rates.add(step(1.1, 0.1, decoded=4, prefilled=1000))
    assert abs(rates.decode_tokens_per_s(1.1) - 4 / 0.4) < 1e-9
    assert abs(rates.prefill_tokens_per_s(1.1) - 3000 / 0.4) < 1e-9
    assert rates.prefill_tokens_per_s(3.2) == 0.0


def test_rates_can_be_read_while_the_engine_thread_adds() -> None:
    """The load report reads the rates on the asyncio thread while the engine thread appends and
    trims; reading used to fail with "deque mutated during iteration"."""
    rates = StepRates()
    done = threading.Event()

    def engine_thread() -> None:
        for i in range(200_000):
            rates.add(step(i * 1e-4, 1e-4, decoded=1, prefilled=i % 2))
        done.set()

    writer = threading.Thread(target=engine_thread)
    writer.start()
    reads = 0
    while not done.is_set():
        assert rates.decode_tokens_per_s(reads * 1e-4) >= 0.0
        assert rates.prefill_tokens_per_s(reads * 1e-4) >= 0.0
        reads += 1
    writer.join()
    assert reads > 0
