"""bench.predictor.cold_cache on a small real artifact: both modes measured, in rounds."""

from __future__ import annotations

from pathlib import Path

from bench.predictor.cold_cache import PROMPTS, measure
from tests.support.predictor_artifact import small_artifact


def test_warm_and_cold_calls_are_measured_alike(tmp_path: Path) -> None:
    result = measure(small_artifact(tmp_path / "artifact"), repeats=12, evict_mib=4, rounds=4)
    modes = result["modes"]
    assert isinstance(modes, dict)
    assert set(modes) == {"warm", "cold"}
    for summary in modes.values():
        assert summary["n"] == 12
        assert 0 < summary["p50_ms"] <= summary["p90_ms"]
    assert result["cold_over_warm_p50"] == modes["cold"]["p50_ms"] / modes["warm"]["p50_ms"]
    assert result["prompts"] == list(PROMPTS)
