"""PredictorService logic: micro-batching, fallback, failure isolation, hot swap.

The predictor here is a small deterministic stand-in that records its batches, so batching is
observable; the real ONNX predictor is exercised through the gateway in the end-to-end tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.prediction.service import PredictorService


@dataclass(frozen=True)
class FixedPrediction:
    bucket: int
    expected_tokens: float
    p90_tokens: int


@dataclass
class LengthByWords:
    """Predicts 10 tokens per prompt word; remembers the batches it was given."""

    version: str = "v1"
    fail: bool = False
    batches: list[list[str]] = field(default_factory=list)

    def predict_batch(self, prompts: list[str]) -> list[FixedPrediction]:
        self.batches.append(list(prompts))
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
