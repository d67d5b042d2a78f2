"""The per-adapter length correction (gateway/prediction/adapter_lengths.py): its arithmetic, and
measured through the request path's prediction stage with a real (small, trained) predictor: an
adapter whose answers are 2x its base's. Its served answers teach the correction; on prompts it
was not taught on, the corrected prediction's mean absolute error must fall well below the
base's.

Measured (pytest -s prints them; 120 served answers taught, 120 other prompts judged): the base's
prediction against the adapter's answers, MAE 169.2 tokens; corrected, 89.9: twice the base
predictor's own error on the base's answers (45.1), the floor of any one-factor correction.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from fedllm_contract.request_options import RequestOptions
from gateway.dispatch.request import PreparedCompletion
from gateway.prediction.adapter_lengths import MAX_RATIO, AdapterLengths
from gateway.prediction.by_model import ModelPredictors
from gateway.prediction.lifecycle import load_predictor
from gateway.prediction.service import Prediction, PredictorService
from gateway.request_path.predict import LengthPrediction
from gateway.sites.interface import GenerateParams
from tests.support.predictor_artifact import small_artifact
from tests.unit.predictor.conftest import synthetic_records

MAX_TOKENS = 2048


def test_ratio_needs_min_samples_and_is_bounded() -> None:
    lengths = AdapterLengths(min_samples=3, window=4)
    for _ in range(2):
        lengths.observe("a", 100, 200)
    assert lengths.ratio("a") is None  # too few: the base stands
    lengths.observe("a", 100, 200)
    assert lengths.ratio("a") == pytest.approx(2.0)
    for _ in range(4):  # the window forgets the old answers
        lengths.observe("a", 100, 50)
    assert lengths.ratio("a") == pytest.approx(0.5)
    for _ in range(4):
        lengths.observe("a", 1, 10_000)
    assert lengths.ratio("a") == MAX_RATIO
    assert lengths.ratio("other") is None
    with pytest.raises(ValueError, match="base"):
        lengths.observe("a", 0, 5)
    with pytest.raises(ValueError, match="min_samples"):
        AdapterLengths(min_samples=5, window=4)


def test_corrected_scales_the_distribution() -> None:
    lengths = AdapterLengths(min_samples=1, window=1)
    base = Prediction(100, 150, 2, "v", (0.5, 0.5), (50.0, 150.0))
    assert lengths.corrected("a", base) is base
    lengths.observe("a", 100, 300)
    got = lengths.corrected("a", base)
    assert (got.tokens, got.p90_tokens, got.representatives) == (300, 450, (150.0, 450.0))
    # Cut at max_tokens as the served answers are: E[min(3L, 200)] = 0.5 * 150 + 0.5 * 200.
    assert got.within(200) == 175


def _prepared(i: int, prompt: str, adapter: str) -> PreparedCompletion:
    params = GenerateParams(f"r{i}", (1, 2, 3), MAX_TOKENS, options=RequestOptions(adapter=adapter))
    return PreparedCompletion(f"r{i}", 0, "base", params, False, False, None, prompt)


async def _measure(artifact: Path) -> tuple[float, float, int]:
    service = PredictorService(load_predictor(artifact))
    service.start()
    stage = LengthPrediction(ModelPredictors(service))
    rng = random.Random(3)
    taught = synthetic_records(120, seed=3, corpus="taught")
    judged = synthetic_records(120, seed=4, corpus="judged")
    try:
        for i, record in enumerate(taught):  # served: the adapter answers 2x (+-10%)
            prepared, _ = await stage.apply(_prepared(i, record.prompt, "verbose"), alone=True)
            actual = round(2 * record.length * rng.uniform(0.9, 1.1))
            stage.served(prepared, actual, "stop")
        base_errors, corrected_errors, own_errors = [], [], []
        for i, record in enumerate(judged):
            prepared, _ = await stage.apply(_prepared(i, record.prompt, "verbose"), alone=True)
            assert prepared.base_predicted_tokens is not None
            assert prepared.params.predicted_tokens is not None
            actual = 2 * record.length
            base_errors.append(abs(prepared.base_predicted_tokens - actual))
            corrected_errors.append(abs(prepared.params.predicted_tokens - actual))
            own_errors.append(abs(prepared.base_predicted_tokens - record.length))
    finally:
        await service.stop()
    samples = stage.adapters.status()["verbose"].samples
    print(
        f"\nthe base predictor on the base's own answers: MAE {sum(own_errors) / len(judged):.1f}"
    )
    return sum(base_errors) / len(judged), sum(corrected_errors) / len(judged), samples


def test_two_x_adapter_correction_lowers_the_error(tmp_path: Path) -> None:
    artifact = small_artifact(tmp_path / "predictor")
    base_mae, corrected_mae, samples = asyncio.run(_measure(artifact))
    print(f"\n2x adapter: base MAE {base_mae:.1f} tokens, corrected {corrected_mae:.1f} "
          f"({samples} answers taught)")  # fmt: skip
    assert samples == 120
    assert corrected_mae < 0.75 * base_mae
