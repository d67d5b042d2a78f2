"""PredictorService logic: micro-batching, inline prediction of a lone short prompt, fallback,
failure isolation, hot swap.

The predictor here is a small deterministic stand-in that records its batches, so batching is
observable; the real ONNX predictor is exercised through the gateway in the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.prediction.service import Prediction, PredictorService


@dataclass(frozen=True)
class FixedPrediction:
    bucket: int
    expected_tokens: float
    p90_tokens: int
    probabilities: tuple[float, ...] = ()


@dataclass
class LengthByWords:
    """Predicts 10 tokens per prompt word; remembers the batches it was given."""

    version: str = "v1"
    bucket_representatives: tuple[float, ...] = ()
    fail: bool = False
    batches: list[list[str]] = field(default_factory=list)
    on_loop_thread: list[bool] = field(default_factory=list)

    def predict_batch(self, prompts: list[str]) -> list[FixedPrediction]:
        self.batches.append(list(prompts))
        self.on_loop_thread.append(threading.current_thread() is threading.main_thread())
        if self.fail:
            raise RuntimeError("model exploded")
        return [FixedPrediction(0, 10.0 * len(p.split()), 20 * len(p.split())) for p in prompts]


async def run(service: PredictorService, prompts: list[str]):
    service.start()
    try:
        return await asyncio.gather(*(service.predict(p) for p in prompts))
    finally:
        await service.stop()


def test_concurrent_prompts_are_predicted_in_one_batch() -> None:
    predictor = LengthByWords()
    service = PredictorService(predictor, max_batch=32, max_wait_s=0.05)
    results = asyncio.run(run(service, ["a", "a b", "a b c"]))
    assert [r.tokens for r in results] == [10, 20, 30]
    assert [r.p90_tokens for r in results] == [20, 40, 60]
    assert {r.version for r in results} == {"v1"}
    assert predictor.batches == [["a", "a b", "a b c"]]


def test_batches_are_capped() -> None:
    predictor = LengthByWords()
    service = PredictorService(predictor, max_batch=2, max_wait_s=0.05)
    asyncio.run(run(service, ["a"] * 5))
    assert [len(b) for b in predictor.batches] == [2, 2, 1]


LONG = "x " * 100  # longer than any inline bound below: always the worker thread


@pytest.mark.parametrize(
    ("inline_chars", "prompt", "alone", "busy", "expected_on_loop"),
    [
        (128, "short prompt", True, False, True),  # alone, short, idle: predicted on the loop
        (128, "x" * 128, True, False, True),  # the bound is inclusive
        (128, "x" * 129, True, False, False),  # longer: the worker thread
        (128, "short prompt", False, False, False),  # other requests in flight: the thread
        (0, "short prompt", True, False, False),  # inline prediction off
        (128, "short prompt", True, True, False),  # a batch is being predicted: queued behind
    ],
)
def test_where_a_prompt_is_predicted(
    inline_chars: int, prompt: str, alone: bool, busy: bool, expected_on_loop: bool
) -> None:
    started, release = threading.Event(), threading.Event()

    @dataclass
    class HoldsTheLongPrompt(LengthByWords):
        def predict_batch(self, prompts: list[str]) -> list[FixedPrediction]:
            if prompts == [LONG]:
                started.set()
                release.wait(5)
            return super().predict_batch(prompts)

    async def scenario() -> list[bool]:
        predictor = HoldsTheLongPrompt()
        service = PredictorService(predictor, inline_chars=inline_chars)
        service.start()
        try:
            if busy:
                held = asyncio.ensure_future(service.predict(LONG))
                assert await asyncio.to_thread(started.wait, 5)
                asyncio.get_running_loop().call_later(0.02, release.set)
            result = await service.predict(prompt, alone=alone)
            assert result is not None
            assert result.tokens == 10 * len(prompt.split())
            if busy:
                await held
            return [
                on_loop
                for batch, on_loop in zip(predictor.batches, predictor.on_loop_thread, strict=True)
                if batch == [prompt]
            ]
        finally:
            release.set()
            await service.stop()

    assert asyncio.run(scenario()) == [expected_on_loop]


def test_an_inline_prediction_is_counted_like_a_batch() -> None:
    async def scenario() -> PredictorService:
        service = PredictorService(LengthByWords(fail=True))
        service.start()
        assert await service.predict("a", alone=True) is None  # the failure is contained
        await service.stop()
        return service

    status = asyncio.run(scenario()).status()
    assert (status.predictions, status.failures) == (0, 1)
    assert status.batch_p50_ms is not None


def test_fallback_mode_predicts_nothing() -> None:
    service = PredictorService(None)
    assert asyncio.run(run(service, ["a"])) == [None]
    assert service.status().mode == "fallback"


def test_a_failing_predictor_leaves_requests_without_prediction() -> None:
    service = PredictorService(LengthByWords(fail=True), max_wait_s=0.01)
    assert asyncio.run(run(service, ["a", "b"])) == [None, None]
    assert service.status().failures == 2


def test_hot_swap_serves_the_new_version_and_a_bad_artifact_keeps_the_old() -> None:
    def loader(path: Path) -> LengthByWords:
        if path.name == "broken":
            raise ValueError("corrupt manifest")
        return LengthByWords(version=path.name)

    async def scenario() -> list[str | None]:
        service = PredictorService(LengthByWords(), loader=loader, max_wait_s=0.001)
        service.start()
        before = await service.predict("x")
        await service.swap(Path("/artifacts/v2"))
        after = await service.predict("x")
        with pytest.raises(ValueError, match="corrupt"):
            await service.swap(Path("/artifacts/broken"))
        still = await service.predict("x")
        await service.stop()
        return [p.version if p else None for p in (before, after, still)]

    assert asyncio.run(scenario()) == ["v1", "v2", "v2"]


def test_the_expected_length_is_cut_at_max_tokens_over_the_distribution() -> None:
    """E[min(L, max_tokens)], not min(E[L], max_tokens): half the answers end at 100 tokens, half
    run to 1,000 (E[L] = 550); cut at 256 they average 178, not 256."""
    spread = Prediction(550, 1000, 1, "v", (0.5, 0.5), (100.0, 1000.0))
    assert spread.within(256) == 178
    assert spread.within(2048) == 550
    assert spread.within(50) == 50
    # A calibrated artifact (its served expectation 20% above the raw one) keeps its ratio.
    calibrated = Prediction(660, 1000, 1, "v", (0.5, 0.5), (100.0, 1000.0))
    assert calibrated.within(256) == round(178 * 1.2)
    assert Prediction(550, 1000, 1, "v").within(256) == 256  # no distribution: capped
