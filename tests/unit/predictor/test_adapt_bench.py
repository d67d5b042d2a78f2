"""The adaptation benchmark's pipeline on a tiny artifact and synthetic traffic: every curve and
table it writes is filled from real runs of the calibrate/retrain/gate code."""

from __future__ import annotations

from dataclasses import replace

from bench.predictor.adapt import METHODS, drift, learning_curves, markdown, plot
from tests.unit.predictor.conftest import synthetic_records


def traffic(n: int, seed: int) -> list:
    corpora = ["alpaca", "dolly", "lima", "gsm8k"]
    return [
        replace(r, corpus=corpora[i % 4], prompt=f"{r.prompt} #{seed}-{i}", length=3 * r.length)
        for i, r in enumerate(synthetic_records(n, seed))
    ]


def test_curves_drift_table_and_plot(sklearn_artifact, tmp_path, monkeypatch):
    stream, test = traffic(160, seed=1), traffic(60, seed=2)
    # sklearn artifacts cannot be fine-tuned: the retrain curve runs the calibrate path twice.
    monkeypatch.setattr("bench.predictor.adapt.RETRAIN_MODE", "calibrate")
    curves, decisions = learning_curves(stream, test, sklearn_artifact, [0, 100, 150], tmp_path)
    assert set(curves) == set(METHODS)
    assert [p["samples"] for p in curves["calibration"]] == [0, 100, 150]
    assert [p["samples"] for p in curves["tfidf"]] == [100, 150]
    base, calibrated = curves["calibration"][0], curves["calibration"][-1]
    assert calibrated["mae_tokens"] < base["mae_tokens"]  # the base is 3x too short
    assert {d["method"] for d in decisions} == {"calibration", "retrain"}
    # 150 samples per corpus: each phase's window leaves enough gate samples for a retrain.
    rows = drift(traffic(600, seed=3), test, sklearn_artifact, tmp_path, seed=0, phase_samples=120)
    assert [r["phase"] for r in rows] == ["alpaca", "dolly", "lima+gsm8k"]
    assert all(r["recalibrated"]["mae_tokens"] > 0 for r in rows)
    assert all(r["retrained"]["mae_tokens"] > 0 for r in rows)
    # The stale retrain is the first phase's: the same model as that phase's retrained one.
    assert rows[0]["stale_retrained"]["mae_tokens"] == rows[0]["retrained"]["mae_tokens"]
    plot(curves, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    table = markdown(curves, decisions, rows)
    assert "| calibration | 150 |" in table
    assert "| dolly | retrained |" in table
