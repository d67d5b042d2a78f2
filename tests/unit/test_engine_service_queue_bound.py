"""The site's queue bound, counted on the engine thread by the queues' lengths, not the engine's
whole stats per request (EngineService._add): those cost O(running rows) of NumPy, whose GIL
releases each cost the engine thread a switch interval beside a busy event loop
(site_engine/__main__.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.serving_path.synthetic_engine import SyntheticEngine
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.answer_stream import Answer
from site_engine.engine.core.api import EngineRequest, EngineStats
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine_service import EngineService, QueueFull


class CountedStats(SyntheticEngine):
    """The synthetic engine, counting the calls of its whole stats."""

    stats_calls = 0

    def stats(self) -> EngineStats:
        self.stats_calls += 1
        return super().stats()


class Quiet:
    def ready(self, answer: Answer) -> None:
        pass


def request(i: int) -> EngineRequest:
    return EngineRequest(f"q{i}", (5, 6, 7), SamplingParams(max_tokens=4))


async def add(service: EngineService, i: int) -> None:
    """Adds request i as the engine thread does (the thread is not started: this is it)."""
    answer, choices = service.open_answer(request(i), Quiet())
    service._add(answer, choices)


def test_the_bound_counts_the_queue_and_takes_no_stats_per_request(
    gpt2_tokenizer_dir: Path,
) -> None:
    tokenizer = load_tokenizer(gpt2_tokenizer_dir)
    engine = CountedStats(rows=2, step_s=0.0, token_ids=[11, 12, 13], max_model_len=64)
    service = EngineService(engine, tokenizer, max_waiting=3)
    calls = engine.stats_calls

    async def scenario() -> None:
        for i in range(3):
            await add(service, i)
        with pytest.raises(QueueFull):
            await add(service, 3)
        assert engine.queue_lengths() == (3, 0)  # the refused one changed nothing
        engine.step()  # two of the three start: one waits
        await add(service, 4)
        await add(service, 5)
        with pytest.raises(QueueFull):
            await add(service, 6)
        # Freed, the queue takes work at once, before any step (a test of the security round
        # found the bound still full after its held requests were cancelled).
        service._abort("q5", FinishReason.CANCELLED)
        await add(service, 7)

    asyncio.run(scenario())
    assert engine.queue_lengths() == (3, 2)
    assert engine.stats_calls == calls  # none by the six adds and two refusals
