"""ModelPredictors: which predictor serves which model, and swapping one model's version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.prediction.by_model import ModelPredictors
from gateway.prediction.service import PredictorService
from tests.unit.test_prediction_service import LengthByWords


def predictors(default: str | None, **own: str | None) -> ModelPredictors:
    def service(version: str | None) -> PredictorService:
        return PredictorService(None if version is None else LengthByWords(version=version))

    return ModelPredictors(service(default), {m: service(v) for m, v in own.items()})


@pytest.mark.parametrize(
    ("default", "own", "model", "expected"),
    [
        ("d", {}, "m", "d"),  # no predictor of its own: the default
        ("d", {"m": "m1"}, "m", "m1"),  # its own
        ("d", {"m": "m1"}, "other", "d"),  # another model's is never used
        ("d", {"m": None}, "m", "d"),  # its own is not loaded (yet): the default
        (None, {"m": "m1"}, "other", None),  # neither: no prediction
        (None, {}, "m", None),
    ],
)
def test_for_model(default, own, model, expected) -> None:
    assert predictors(default, **own).version(model) == expected


def test_predict_goes_to_the_models_own_predictor() -> None:
    async def scenario() -> tuple[str | None, str | None]:
        models = predictors("d", m="m1")
        models.start()
        try:
            mine = await models.predict("m", "two words")
            theirs = await models.predict("x", "two words")
            return (mine.version if mine else None), (theirs.version if theirs else None)
        finally:
            await models.stop()

    assert asyncio.run(scenario()) == ("m1", "d")


def test_swap_adds_a_model_or_keeps_the_current_one_on_failure() -> None:
    def loader(path: Path) -> LengthByWords:
        if path.name == "broken":
            raise ValueError("not an artifact")
        return LengthByWords(version=path.name)

    async def scenario() -> list[str | None]:
        models = ModelPredictors(PredictorService(LengthByWords(version="d")), loader=loader)
        models.start()
        try:
            await models.swap("m", Path("/a/m1"))
            seen = [models.version("m")]
            with pytest.raises(ValueError, match="not an artifact"):
                await models.swap("m", Path("/a/broken"))
            seen.append(models.version("m"))
            with pytest.raises(ValueError, match="not an artifact"):
                await models.swap("new", Path("/a/broken"))
            seen.append(models.version("new"))
            prediction = await models.predict("m", "a b c")
            seen.append(prediction.version if prediction else None)
            return seen
        finally:
            await models.stop()

    assert asyncio.run(scenario()) == ["m1", "m1", "d", "m1"]
