"""A real, small length-predictor artifact (sklearn, trained in seconds) for tests that need a
gateway serving predictions."""

from __future__ import annotations

from pathlib import Path

from predictor.baseline import SklearnConfig
from predictor.training import TrainingSet, TrainSpec, train_artifact
from tests.unit.predictor.conftest import synthetic_records


def small_artifact(out: Path, seed: int = 1) -> Path:
    """Trains into `out`; log-spaced buckets so short answers still span several. Another seed
    gives another training set, so another version."""
    data = TrainingSet(
        synthetic_records(120, seed=seed), synthetic_records(40, seed=seed + 1, corpus="v")
    )
    spec = TrainSpec("sklearn", "log_n10_l1024", sklearn=SklearnConfig(max_iter=200))
    train_artifact(spec, data, out, progress=lambda _: None)
    return out
